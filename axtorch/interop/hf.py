"""Read and write Hugging Face checkpoint directories (``config.json`` + safetensors).

Each family's config and tensor mapping is its adapter in ``interop.families``, which also picks
the family; this module is the file layer: single-file and sharded safetensors, streamed one
tensor at a time so that loading never holds a model twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import tokenizers
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import processors

from axtorch.data.tokenizer import Tokenizer
from axtorch.interop.families import config_from_hf, family_for, hf_family, model_from_hf_tensors
from axtorch.models.causal_lm import CausalLM, CausalLMConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
#: transformers' default ``max_shard_size`` ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000


def hf_tokenizer(directory: str | os.PathLike[str]) -> tuple[Tokenizer, Optional[str]]:
    """An HF directory's ``tokenizer.json`` with its end-of-sequence token, and its chat template (or None).

    Both come from ``tokenizer_config.json`` (``eos_token``, ``chat_template``); without an
    ``eos_token`` there, ``config.json``'s ``eos_token_id`` names it.
    """
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(f"{directory} has no tokenizer.json")
    settings_file = directory / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    eos = settings.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is None:
        inner = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        eos_id = json.loads((directory / CONFIG_FILE).read_text()).get("eos_token_id")
        eos = inner.id_to_token(eos_id[0] if isinstance(eos_id, list) else eos_id) if eos_id is not None else None
    if eos is None:
        raise ValueError(f"{directory}: neither tokenizer_config.json nor config.json names an end-of-sequence token")
    template = settings.get("chat_template")
    return Tokenizer.load(directory / "tokenizer.json", eos), template if isinstance(template, str) else None


def save_hf_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike[str]) -> None:
    """``tokenizer.json`` and a ``tokenizer_config.json`` with the model's special tokens and chat
    template (the tokenizer's own settings), as ``transformers.AutoTokenizer`` and ``hf_tokenizer`` read them."""
    directory = Path(directory)
    # One write of tokenizer.json (with the BOS post-processor) and generation_config.json's end-of-turn ids.
    exported = Tokenizer(_adding_bos(tokenizer), tokenizer.eos_token, tokenizer.settings, tokenizer.stop_ids)
    exported.save(directory / "tokenizer.json")
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,  # unless the tokenizer's settings say it adds one
        **tokenizer.settings,
        "eos_token": tokenizer.eos_token,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")


def _adding_bos(tokenizer: Tokenizer) -> tokenizers.Tokenizer:
    """The tokenizer with a post-processor that starts every text with BOS where the model's
    tokenizer adds one: transformers' generic ``PreTrainedTokenizerFast`` ignores ``add_bos_token``."""
    inner = tokenizers.Tokenizer.from_str(json.dumps(tokenizer.description()))
    bos_id = tokenizer.bos_id
    if bos_id is None or inner.encode("a").ids[:1] == [bos_id]:
        return inner
    bos = inner.id_to_token(bos_id)
    template = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]
    )
    inner.post_processor = (
        template if inner.post_processor is None else processors.Sequence([inner.post_processor, template])
    )
    return inner


def from_hf(directory: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> tuple[CausalLM, CausalLMConfig]:
    """Load a HF checkpoint directory of any registered family (``interop.families.FAMILIES``).

    Tensors are read in the checkpoint's dtype and cast to ``dtype``. Raises ``ValueError`` for a
    model type or config feature axtorch cannot represent.
    """
    directory = Path(directory)
    hf_config = json.loads((directory / CONFIG_FILE).read_text())
    config = config_from_hf(hf_config)
    family = hf_family(hf_config)
    return model_from_hf_tensors(family, config, _read_safetensors(directory), dtype), config


def hf_model_config(directory: str | os.PathLike[str]) -> CausalLMConfig:
    """The model config of an HF checkpoint directory, from its ``config.json`` alone (no weight is read)."""
    return config_from_hf(json.loads((Path(directory) / CONFIG_FILE).read_text()))


def _weight_files(directory: Path) -> list[Path]:
    index = directory / WEIGHTS_INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE]
    raise FileNotFoundError(
        f"{directory} has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE} (only safetensors are read)"
    )


def _read_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in _weight_files(directory):
        with safe_open(path, framework="pt") as file:
            for name in file.keys():  # noqa: SIM118 -- safe_open has keys() but is not iterable
                yield name, file.get_tensor(name)


def to_hf(
    model: CausalLM,
    directory: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write ``model`` as a checkpoint that ``transformers`` loads as is.

    The family is the first registered one that can express the model (``families.family_for``:
    GPT-2 for absolute position embeddings, else Llama unless the model needs more, e.g. Mistral
    for a sliding window, Qwen3 for QK-norm, Mixtral for experts). ``dtype`` defaults to the
    model's. Weights over ``max_shard_bytes`` are split into ``model-0000i-of-0000n.safetensors``
    files plus an index. An earlier export in ``directory``
    is replaced. Raises ``ValueError`` (before writing anything) if no family can express the model.
    """
    family, hf_config = family_for(model.config)
    dtype = dtype or next(model.parameters()).dtype
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    state = family.tensors_to_hf(model.config, model.state_dict())
    shards = _plan_shards(state, dtype.itemsize, max_shard_bytes)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in [
        directory / WEIGHTS_FILE,
        directory / WEIGHTS_INDEX_FILE,
        *directory.glob("model-*-of-*.safetensors"),
    ]:
        stale.unlink(missing_ok=True)
    names = (
        [WEIGHTS_FILE]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    for file_name, shard in zip(names, shards):
        tensors = {name: state[name].detach().to(device="cpu", dtype=dtype).contiguous() for name in shard}
        save_file(tensors, directory / file_name, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() for t in state.values()) * dtype.itemsize},
            "weight_map": {name: file_name for file_name, shard in zip(names, shards) for name in shard},
        }
        (directory / WEIGHTS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")


def _plan_shards(state: dict[str, torch.Tensor], itemsize: int, max_shard_bytes: int) -> list[list[str]]:
    """Consecutive groups of names, each at most ``max_shard_bytes`` unless one tensor alone is larger."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, tensor in state.items():
        size = tensor.numel() * itemsize
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
    return shards
