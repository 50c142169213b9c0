"""The registry of model families: one adapter each (``family.Family``), one line each here.

HF import and export (``interop.hf``), GGUF import and export (``interop.gguf``,
``interop.gguf_export``) and ``init_from`` find a family only through these functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from axtorch.interop.assembly import model_from_state_dict
from axtorch.interop.families.family import CannotExpress, Family, NamedTensor, getter
from axtorch.interop.families.gemma import GEMMA
from axtorch.interop.families.gemma2 import GEMMA2
from axtorch.interop.families.gemma3 import GEMMA3
from axtorch.interop.families.gpt2 import GPT2
from axtorch.interop.families.llama import LLAMA
from axtorch.interop.families.mistral import MISTRAL
from axtorch.interop.families.mixtral import MIXTRAL
from axtorch.interop.families.qwen2 import QWEN2
from axtorch.interop.families.qwen2_moe import QWEN2_MOE
from axtorch.interop.families.qwen3 import QWEN3
from axtorch.interop.families.qwen3_moe import QWEN3_MOE
from axtorch.models.causal_lm import CausalLM, CausalLMConfig

#: Export writes the first family that can express a model, so the simplest come first.
FAMILIES: tuple[Family, ...] = (
    GPT2,
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    GEMMA,
    GEMMA2,
    GEMMA3,
    MIXTRAL,
    QWEN2_MOE,
    QWEN3_MOE,
)
#: A ``config.json`` without a ``model_type`` is read as this family's.
DEFAULT_MODEL_TYPE = LLAMA.model_type

__all__ = [
    "FAMILIES",
    "CannotExpress",
    "Family",
    "config_from_hf",
    "family_for",
    "family_of",
    "gguf_architectures",
    "gguf_families",
    "hf_family",
    "model_from_hf_tensors",
]


def family_of(model_type: str) -> Family:
    """The family of a HF ``model_type``; ``ValueError`` listing the supported ones."""
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    supported = ", ".join(family.model_type for family in FAMILIES)
    raise ValueError(f"HF config model_type={model_type!r} is not supported; supported: {supported}")


def family_for(config: CausalLMConfig) -> tuple[Family, dict[str, Any]]:
    """The first family (the simplest) that can express ``config``, with its ``config.json`` dict.

    ``CannotExpress`` lists, for each family, the first feature it lacks.
    """
    refusals = {}
    for family in FAMILIES:
        try:
            return family, family.config_to_hf(config)
        except CannotExpress as error:
            refusals[family.architecture] = str(error).split(": ", 1)[-1]
    details = "; ".join(f"{architecture}: {reason}" for architecture, reason in refusals.items())
    raise CannotExpress(f"no HF family can express this model ({details})")


def gguf_families(architecture: str) -> list[Family]:
    """The families llama.cpp runs as GGUF ``general.architecture``, in registry order."""
    return [family for family in FAMILIES if family.gguf is not None and family.gguf.architecture == architecture]


def gguf_architectures() -> list[str]:
    return sorted({family.gguf.architecture for family in FAMILIES if family.gguf is not None})


def hf_family(hf: Mapping[str, Any] | Any) -> Family:
    """The family of a HF config (``config.json`` dict or transformers object)."""
    return family_of(getter(hf)("model_type", DEFAULT_MODEL_TYPE))


def config_from_hf(hf: Mapping[str, Any] | Any) -> CausalLMConfig:
    """An axtorch config equal in function to a HF config (``config.json`` dict or transformers object)."""
    return hf_family(hf).config_from_hf(getter(hf))


def model_from_hf_tensors(
    family: Family, config: CausalLMConfig, tensors: Iterable[NamedTensor], dtype: torch.dtype
) -> CausalLM:
    """Build ``config`` around the family's HF-named ``tensors`` cast to ``dtype``, lazily (see
    ``model_from_state_dict``: no tensor is held twice)."""
    cast = ((name, tensor.to(dtype)) for name, tensor in tensors)
    return model_from_state_dict(config, dict(family.tensors_from_hf(config, cast)))
