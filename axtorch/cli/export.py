"""``axtorch-export``: write a trained run as a GGUF file or an HF checkpoint directory.

    axtorch-export checkpoint=runs/quickstart to=gguf:quickstart.gguf
    axtorch-export checkpoint=runs/quickstart to=gguf:quickstart-q8.gguf dtype=q8_0
    axtorch-export checkpoint=runs/quickstart/checkpoints/step_00000250 to=hf:quickstart-hf

``checkpoint`` is a run directory (its newest valid checkpoint) or one checkpoint directory.
A GGUF file runs in llama.cpp and Ollama and loads in transformers (``gguf_file=``); an HF
directory holds ``config.json``, safetensors weights and the tokenizer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from axtorch.cli.key_values import read_config
from axtorch.config.errors import ConfigError
from axtorch.interop.gguf_export import GGUF_DTYPES, to_gguf
from axtorch.interop.hf import save_hf_tokenizer, to_hf
from axtorch.train.checkpoint_manifest import CheckpointError
from axtorch.train.trained_model import load_trained_model

_HF_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class ExportConfig:
    #: A run directory (its newest valid checkpoint) or one checkpoint directory.
    checkpoint: Optional[str] = None
    #: ``gguf:FILE`` or ``hf:DIR``.
    to: Optional[str] = None
    #: GGUF: f32, f16 or q8_0 (default f16). HF: f32, f16 or bf16 (default: the checkpoint's).
    dtype: Optional[str] = None

    def validate(self) -> None:
        if not self.checkpoint:
            raise ConfigError("checkpoint", self.checkpoint, "a run directory or a checkpoints/step_* directory")
        kind, _, target = (self.to or "").partition(":")
        if kind not in ("gguf", "hf") or not target:
            raise ConfigError("to", self.to, "gguf:FILE or hf:DIR")
        allowed = GGUF_DTYPES if kind == "gguf" else tuple(_HF_DTYPES)
        if self.dtype is not None and self.dtype not in allowed:
            raise ConfigError("dtype", self.dtype, f"one of {', '.join(allowed)} for {kind}")


def main(argv: list[str] | None = None) -> int:
    try:
        config = read_config("axtorch-export", argv, ExportConfig, __doc__ or "")
        if config is None:
            return 0
        model, tokenizer = load_trained_model(Path(str(config.checkpoint)), torch.device("cpu"))
        kind, _, target = str(config.to).partition(":")
        if kind == "gguf":
            to_gguf(model, tokenizer, target, config.dtype or "f16")
        else:
            to_hf(model, target, None if config.dtype is None else _HF_DTYPES[config.dtype])
            save_hf_tokenizer(tokenizer, target)
    except (ConfigError, CheckpointError, ValueError, OSError) as error:
        print(f"axtorch-export: {error}", file=sys.stderr)
        return 2
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
