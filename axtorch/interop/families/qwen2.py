"""Qwen2 (and Qwen2.5): Llama with biases on the query, key and value projections only, and a
sliding window (``use_sliding_window``) in the layers ``layer_types`` names, by default those from
``max_window_layers`` on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axtorch.interop.families.family import GGUFLayout
from axtorch.interop.families.layer_types import refuse_sliding_window, with_qwen_windows
from axtorch.interop.families.llama_layout import LlamaLayout, attention_biases, mlp_bias, qkv_biases
from axtorch.layers.attention_mask import CausalMaskConfig
from axtorch.models.causal_lm import CausalLMConfig


def _fields(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    require(attention_biases(config) == (True, False), "attention without biases on q/k/v only (it has exactly those)")
    require(not mlp_bias(config), "feed-forward biases")
    return {}


QWEN2 = with_qwen_windows(
    LlamaLayout(
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        mask=lambda get: CausalMaskConfig(),
        biases=qkv_biases,
        fields=_fields,
        gguf=GGUFLayout("qwen2", refuses=refuse_sliding_window),
    ).family()
)
