"""``axtorch-generate``: continue prompts with a trained run, a GGUF file or an HF directory.

    axtorch-generate checkpoint=runs/quickstart prompt="def main(" max_new_tokens=64
    axtorch-generate checkpoint=runs/quickstart/checkpoints/step_00000250 prompt="import " sampling.temperature=0.8
    axtorch-generate gguf=SmolLM2-135M-Instruct.Q4_1.gguf chat=true prompt="What is a tensor?"
    axtorch-generate hf=path/to/hf_dir prompts_file=prompts.txt sampling.temperature=0.7 sampling.min_p=0.05

``checkpoint`` is a checkpoint directory or a run directory (its newest checkpoint is used); the
model config and tokenizer come from the run directory the checkpoint belongs to. One prompt
streams its text as it is decoded; a prompts file (one prompt per line) is decoded as one batch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from axtorch.cli.key_values import read_config
from axtorch.config.errors import ConfigError
from axtorch.data.tokenizer import Tokenizer
from axtorch.infer import generate
from axtorch.infer.cpu_weights import DecodeKernel, kernel_refusal, quantize_int8
from axtorch.infer.decoding import prompt_text
from axtorch.infer.sampling import SamplingConfig
from axtorch.models.causal_lm import CausalLM
from axtorch.parallel.single import resolve_device
from axtorch.train.checkpoint_manifest import CheckpointError
from axtorch.train.trained_model import load_trained_model


@dataclass
class DecodeOptions:
    #: The CPU decode kernel of float32 weights (``cpu_weights.DecodeKernel``): auto, the rule's
    #: (axtorch's own where it compiled here, else torch's linear), or linear, transposed, packed,
    #: native, native_float32 (axtorch's own, never reading block codes). Chosen, never timed: the
    #: same prompt gives the same tokens on every run.
    kernel: str = "auto"

    def validate(self, compile: bool) -> None:
        names = ["auto", *(kernel.name for kernel in DecodeKernel)]
        if self.kernel not in names:
            raise ConfigError("decode.kernel", self.kernel, f"one of {names}")
        if refusal := kernel_refusal(self.chosen(), compile):
            allowed = "auto or linear with compile=true" if compile else "auto or a kernel this machine has"
            raise ConfigError("decode.kernel", self.kernel, allowed, reason=refusal)

    def chosen(self) -> DecodeKernel | None:
        return None if self.kernel == "auto" else DecodeKernel[self.kernel]


@dataclass
class GenerateConfig:
    #: Exactly one source: an axtorch run or checkpoint directory, a GGUF file, or an HF directory.
    checkpoint: Optional[str] = None
    #: A GGUF file (llama.cpp's format) to load instead.
    gguf: Optional[str] = None
    #: An HF checkpoint directory (config.json, safetensors, tokenizer) to load instead.
    hf: Optional[str] = None
    #: One prompt, or a file of prompts, one per line, decoded together as one batch.
    prompt: Optional[str] = None
    #: A file of prompts, one per line (instead of prompt).
    prompts_file: Optional[str] = None
    #: Tokens to decode after each prompt, at most.
    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    #: Strings that end a row (its text is cut before them), besides the model's end-of-sequence
    #: and end-of-turn tokens.
    stop: list[str] = field(default_factory=list)
    #: Wrap each prompt as a user message in the model's chat template (``generate``'s ``chat``).
    chat: bool = False
    #: "int8": int8 weights for the attention projections and the output head (CPU only).
    quantize: Optional[str] = None
    #: On the CPU, decode float32 weights in decode formats (q/k/v and gate/up stacked, multiplied by
    #: ``decode.kernel``): the same math (``generate``'s ``pack``, ``cpu_weights.decode_weights``).
    #: Ignored elsewhere.
    pack: bool = True
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    #: Compile the decode step (torch.compile; CUDA graphs on a GPU): slow to start, faster per token.
    compile: bool = False
    #: Row i samples with seed + i.
    seed: int = 0
    #: auto, cpu, cuda[:N], or xla: this host's XLA device, each decode step one compiled program.
    device: str = "auto"

    def validate(self) -> None:
        sources = [key for key in ("checkpoint", "gguf", "hf") if getattr(self, key)]
        if len(sources) != 1:
            raise ConfigError(
                "checkpoint|gguf|hf", sources or None, "exactly one of checkpoint=DIR, gguf=FILE or hf=DIR"
            )
        if (self.prompt is None) == (self.prompts_file is None):
            raise ConfigError("prompt|prompts_file", self.prompt or self.prompts_file, "exactly one of the two")
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens", self.max_new_tokens, "a positive integer")
        if self.device == "xla" and self.sampling.temperature > 0:
            raise ConfigError(
                "sampling.temperature",
                self.sampling.temperature,
                "0 (greedy) with device=xla",
                reason="seeded per-row sampling needs torch.Generator, which torch_xla lacks",
            )
        if self.quantize not in (None, "int8"):
            raise ConfigError("quantize", self.quantize, "null or int8")
        self.sampling.validate("sampling")
        self.decode.validate(self.compile)


def load_source(config: GenerateConfig, device: torch.device) -> tuple[CausalLM, Tokenizer]:
    """The model and its tokenizer, with the settings (chat template, special tokens) that came with it."""
    if config.checkpoint:
        return load_trained_model(Path(config.checkpoint), device)
    if config.gguf:
        from axtorch.interop.gguf import from_gguf

        model, _, tokenizer = from_gguf(config.gguf)
        return model.to(device).eval(), tokenizer
    from axtorch.interop.hf import from_hf, hf_tokenizer

    model, _ = from_hf(str(config.hf))
    tokenizer, _ = hf_tokenizer(str(config.hf))
    return model.to(device).eval(), tokenizer


def main(argv: list[str] | None = None) -> int:
    try:
        config = read_config("axtorch-generate", argv, GenerateConfig, __doc__ or "")
        if config is None:
            return 0
        prompts = [config.prompt] if config.prompt is not None else _read_prompts(Path(str(config.prompts_file)))
        step_boundary = None
        if config.device == "xla":
            from axtorch.parallel.xla import decode_device  # imports torch_xla: only when asked for

            device, step_boundary = decode_device()
        else:
            device = resolve_device(config.device, "device")
        model, tokenizer = load_source(config, device)
        # What each row continues: with chat, the prompt as the model's template renders it.
        shown = [prompt_text(tokenizer, prompt) for prompt in prompts] if config.chat else prompts
        if config.quantize == "int8":
            model = quantize_int8(model)
    except (ConfigError, CheckpointError, ValueError, OSError, ImportError) as error:
        print(f"axtorch-generate: {error}", file=sys.stderr)
        return 2
    stream = None
    if len(prompts) == 1:  # one prompt: its text appears as it is decoded
        print(shown[0], end="", flush=True)
        stream = lambda _, text: print(text, end="", flush=True)  # noqa: E731
    results = generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=config.max_new_tokens,
        sampling=config.sampling,
        stop=config.stop,
        seeds=[config.seed + row for row in range(len(prompts))],
        stream=stream,
        sync_every=1 if stream else 8,
        compile=config.compile,
        step_boundary=step_boundary,
        pack=config.pack,
        kernel=config.decode.chosen(),
        chat=config.chat,
    )
    if stream:
        print()
        return 0
    for index, (prompt, result) in enumerate(zip(shown, results)):
        print(f"--- prompt {index} ({result.finish_reason}, {len(result.token_ids)} new tokens)")
        print(prompt + result.text)
    return 0


def _read_prompts(path: Path) -> list[str]:
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("prompts_file", str(path), "a file with one prompt per line", reason="it holds none")
    return prompts


if __name__ == "__main__":
    raise SystemExit(main())
