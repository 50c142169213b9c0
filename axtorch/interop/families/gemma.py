"""Gemma (the first generation): the Llama layout with GELU-tanh gated MLPs, token vectors scaled
by sqrt(dim), norms that multiply by ``1 + weight``, a head size of 256 and a tied head.

What every Gemma generation shares is here (``GEMMA_LAYOUT``, ``refuse_bidirectional``); Gemma 2
and 3, whose layers differ, build on it in ``gemma_layout.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axtorch.interop.families.family import Getter, GGUFLayout
from axtorch.interop.families.llama_layout import (
    attention_bias_field,
    llama_biases,
    llama_layout_family,
    mask_from_layer_types,
    mlp_bias,
    sliding_window,
)
from axtorch.layers.attention_mask import MaskConfig
from axtorch.models.causal_lm import CausalLMConfig

#: ``llama_layout_family`` arguments of every Gemma generation.
GEMMA_LAYOUT: dict[str, Any] = {
    "biases": llama_biases,
    "default_head_dim": 256,
    "default_activation": "gelu_pytorch_tanh",
    "default_tie": True,
    "scaled_embedding": True,
    "norm_offset": 1.0,
}


def refuse_bidirectional(get: Getter) -> None:
    """Gemma configs may ask for bidirectional attention (embedding models); axtorch decoders are causal."""
    if get("use_bidirectional_attention", False):
        raise ValueError("HF config use_bidirectional_attention=True is not supported: axtorch decoders are causal")


def _mask(get: Getter) -> MaskConfig:
    refuse_bidirectional(get)
    return mask_from_layer_types(None, get("layer_types"))


def _fields(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    qkv = attention_bias_field(config, require)
    require(not mlp_bias(config), "feed-forward biases")
    require(sliding_window(config) is None, "a sliding window")
    return {"attention_bias": qkv}


GEMMA = llama_layout_family(
    "gemma",
    "GemmaForCausalLM",
    mask=_mask,
    fields=_fields,
    gguf=GGUFLayout("gemma", norm_offset=1.0),
    **GEMMA_LAYOUT,
)
