"""Qwen3: Llama with RMSNorms on each head's queries and keys, and a head size of 128 by default."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axtorch.interop.families.family import GGUFLayout
from axtorch.interop.families.llama_layout import (
    attention_bias_field,
    llama_biases,
    llama_layout_family,
    mlp_bias,
    qwen_window_fields,
    qwen_window_mask,
    sliding_window,
)
from axtorch.models.causal_lm import CausalLMConfig


def _fields(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    qkv = attention_bias_field(config, require)
    require(not mlp_bias(config), "feed-forward biases")
    return {
        "attention_bias": qkv,
        **qwen_window_fields(sliding_window(config), config.decoder.num_layers, all_layers=False),
    }


QWEN3 = llama_layout_family(
    "qwen3",
    "Qwen3ForCausalLM",
    mask=lambda get: qwen_window_mask(get, all_layers=False),
    biases=llama_biases,
    fields=_fields,
    qk_norm=True,
    default_head_dim=128,
    gguf=GGUFLayout("qwen3"),
)
