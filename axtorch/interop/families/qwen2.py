"""Qwen2 (and Qwen2.5): Llama with biases on the query, key and value projections only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axtorch.interop.families.family import GGUFLayout
from axtorch.interop.families.llama_layout import (
    attention_biases,
    llama_layout_family,
    mlp_bias,
    qkv_biases,
    qwen_window_fields,
    qwen_window_mask,
    sliding_window,
)
from axtorch.models.causal_lm import CausalLMConfig


def _fields(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    require(attention_biases(config) == (True, False), "attention without biases on q/k/v only (it has exactly those)")
    require(not mlp_bias(config), "feed-forward biases")
    return qwen_window_fields(sliding_window(config), config.decoder.num_layers, all_layers=False)


QWEN2 = llama_layout_family(
    "qwen2",
    "Qwen2ForCausalLM",
    mask=lambda get: qwen_window_mask(get, all_layers=False),
    biases=qkv_biases,
    fields=_fields,
    gguf=GGUFLayout("qwen2"),
)
