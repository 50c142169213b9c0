"""Gemma (the first generation): the Llama layout with GELU-tanh gated MLPs, token vectors scaled
by sqrt(dim), norms that multiply by ``1 + weight``, a head size of 256 and a tied head.

What every Gemma generation shares (``GEMMA_LAYOUT``, ``refuse_bidirectional``) lives in
``gemma_layout.py``, beside the factory of Gemma 2 and 3, whose layers differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axtorch.interop.families.family import Getter, GGUFLayout
from axtorch.interop.families.gemma_layout import GEMMA_LAYOUT, refuse_bidirectional
from axtorch.interop.families.llama_layout import (
    LlamaLayout,
    attention_bias_field,
    mask_from_layer_types,
    mlp_bias,
    sliding_window,
)
from axtorch.layers.attention_mask import MaskConfig
from axtorch.models.causal_lm import CausalLMConfig


def _mask(get: Getter) -> MaskConfig:
    refuse_bidirectional(get)
    return mask_from_layer_types(None, get("layer_types"))


def _fields(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    qkv = attention_bias_field(config, require)
    require(not mlp_bias(config), "feed-forward biases")
    require(sliding_window(config) is None, "a sliding window")
    return {"attention_bias": qkv}


GEMMA = LlamaLayout(
    model_type="gemma",
    architecture="GemmaForCausalLM",
    mask=_mask,
    fields=_fields,
    gguf=GGUFLayout("gemma", norm_offset=1.0),
    **GEMMA_LAYOUT,
).family()
