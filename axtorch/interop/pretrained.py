"""``init_from=hf:DIR`` / ``init_from=gguf:FILE``: start training from imported weights.

The run's own model config must describe the same network as the imported one (choose the
matching preset, e.g. ``model=smollm2_135m``); anything that differs, apart from initialisation
settings, a router's loss weights and the maximum length (unless it sizes a learned position
table), is an error naming the differing keys rather than a silent partial load. The tokenizer
comes with the weights: a GGUF's own, or the HF directory's ``tokenizer.json``, with what the
model's own tokenizer adds (BOS) and ends with (EOS, end-of-turn), which the data path takes
unless ``data.tokenizer.eos_token`` names another EOS.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from axtorch.config.errors import ConfigError
from axtorch.config.serialize import config_to_dict
from axtorch.models.causal_lm import CausalLM, CausalLMConfig

#: Settings that do not change the network a checkpoint holds: initialisation, the maximum length,
#: the weights of a router's training losses (HF's are one coefficient, axtorch's per layer),
#: dropout, and the transforms training applies to the imported network: adapters
#: (``model/adapter``), the format of its frozen base (``model/frozen_base``), float8 matmuls
#: (``model/float8``) and activation checkpointing (``model/remat``).
TRAINING_ONLY_KEYS = frozenset(
    {
        "init",
        "max_seq_len",
        "load_balancing_loss_weight",
        "z_loss_weight",
        "dropout",
        "embedding_dropout",
        "adapter",
        "frozen_base",
        "float8",
        "remat",
    }
)
#: float32's unit roundoff (2**-24) with headroom: a value read back from float32 is this close.
_FLOAT32_RELATIVE_PRECISION = 1e-6


@dataclass
class Pretrained:
    model: CausalLM
    config: CausalLMConfig
    #: A tokenizer.json that matches the weights.
    tokenizer_path: Path

    def release_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, value)`` of every imported parameter, each removed from ``model`` as it is handed out.

        A run copies each value into its own (possibly sharded) parameter: handing them out this
        way frees each imported tensor once its copy is made, instead of holding the whole model
        twice at the import's peak. ``model`` is left without parameters.
        """
        for name in [name for name, _ in self.model.named_parameters()]:
            module_name, _, leaf = name.rpartition(".")
            module = self.model.get_submodule(module_name)
            value = getattr(module, leaf).detach()
            setattr(module, leaf, None)
            yield name, value


def keeps_the_weights(key: str) -> bool:
    """Whether the dotted model-config ``key`` (``decoder.layer.attention.dropout``) is training-only,
    so a run may set it on top of imported weights."""
    return any(part in TRAINING_ONLY_KEYS for part in key.split("."))


def _parse(source: str) -> tuple[str, Path]:
    kind, _, location = source.partition(":")
    if kind not in ("hf", "gguf"):
        raise ConfigError("init_from", source, "hf:<directory> or gguf:<file>")
    return kind, Path(location).expanduser()


def pretrained_tokenizer_path(source: str, scratch_dir: Path) -> Path:
    """Where the tokenizer matching ``source`` lives (a GGUF's is extracted into ``scratch_dir``)."""
    kind, path = _parse(source)
    return path / "tokenizer.json" if kind == "hf" else scratch_dir / "pretrained_tokenizer.json"


def pretrained_model_config(source: str) -> CausalLMConfig:
    """The model config ``hf:DIR`` or ``gguf:FILE`` describes, read without its weights: once per
    file and version of it in a process (``axtorch-train`` composes up to three times before it
    trains, and opening Gemma 3's GGUF takes 2.5 s)."""
    kind, path = _parse(source)
    try:
        described = path / "config.json" if kind == "hf" else path
        stat = described.stat()
        return copy.deepcopy(_model_config(kind, str(path), stat.st_mtime_ns, stat.st_size))
    except (OSError, ValueError) as error:
        allowed = "an HF directory or GGUF file axtorch can read"
        raise ConfigError("init_from", source, allowed, reason=str(error)) from error


@functools.lru_cache(maxsize=8)
def _model_config(kind: str, path: str, modified_ns: int, size: int) -> CausalLMConfig:
    """``pretrained_model_config``'s reading, keyed by the file's version (its time and size)."""
    if kind == "hf":
        from axtorch.interop.hf import hf_model_config

        return hf_model_config(path)
    from axtorch.interop.gguf import gguf_model_config

    return gguf_model_config(path)


def load_pretrained(source: str, scratch_dir: Path) -> Pretrained:
    """Read ``hf:DIR`` or ``gguf:FILE``; a GGUF's tokenizer is written to ``scratch_dir``."""
    kind, path = _parse(source)
    tokenizer_path = pretrained_tokenizer_path(source, scratch_dir)
    if kind == "hf":
        from axtorch.interop.hf import from_hf

        model, config = from_hf(path)
        if not tokenizer_path.is_file():
            raise ConfigError(
                "init_from", source, "an HF directory with a tokenizer.json", reason=f"no {tokenizer_path}"
            )
        return Pretrained(model, config, tokenizer_path)
    from axtorch.interop.gguf import from_gguf

    model, config, tokenizer = from_gguf(path)
    scratch_dir.mkdir(parents=True, exist_ok=True)
    # With its settings and end-of-turn ids beside it, where ``Tokenizer.load`` finds them: the
    # BOS and EOS every document gets, the chat template (``data=chat``), where generation stops.
    tokenizer.save(tokenizer_path)
    return Pretrained(model, config, tokenizer_path)


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        if key in TRAINING_ONLY_KEYS:
            continue
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _architecture(config: CausalLMConfig) -> dict[str, object]:
    flat = _flatten(config_to_dict(config))
    attention = config.decoder.layer.attention
    head_dim = attention.resolved_head_dim(config.dim)
    flat["decoder.layer.attention.head_dim"] = head_dim
    # null is 1/sqrt(head_dim): a file that writes the scale out holds the same network
    flat["decoder.layer.attention.softmax_scale"] = attention.softmax_scale or head_dim**-0.5
    if config.position_embedding is not None:  # then max_seq_len is the position table's size
        flat["max_seq_len"] = config.max_seq_len
    return flat


def _same_setting(mine: object, imported: object) -> bool:
    """Equal, with floats equal to float32 precision: GGUF files store eps and theta as float32."""
    if isinstance(mine, float) and isinstance(imported, float):
        return math.isclose(mine, imported, rel_tol=_FLOAT32_RELATIVE_PRECISION)
    return mine == imported


def check_same_architecture(ours: CausalLMConfig, theirs: CausalLMConfig, source: str) -> None:
    mine, imported = _architecture(ours), _architecture(theirs)
    differing = sorted(k for k in mine.keys() | imported.keys() if not _same_setting(mine.get(k), imported.get(k)))
    if differing:
        details = ", ".join(f"model.{k}={mine.get(k)!r} vs {imported.get(k)!r}" for k in differing[:6])
        raise ConfigError(
            "init_from",
            source,
            "a model config describing the same network as the imported weights",
            reason=f"{len(differing)} model settings differ: {details}",
        )
