"""Qwen3: Llama with RMSNorms on each head's queries and keys, a head size of 128 by default, and
Qwen2's sliding window in the layers ``layer_types`` names (by default from ``max_window_layers`` on)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axtorch.interop.families.family import GGUFLayout
from axtorch.interop.families.layer_types import refuse_sliding_window, with_qwen_windows
from axtorch.interop.families.llama_layout import LlamaLayout, attention_bias_field, llama_biases, mlp_bias
from axtorch.layers.attention_mask import CausalMaskConfig
from axtorch.models.causal_lm import CausalLMConfig


def _fields(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    qkv = attention_bias_field(config, require)
    require(not mlp_bias(config), "feed-forward biases")
    return {"attention_bias": qkv}


QWEN3 = with_qwen_windows(
    LlamaLayout(
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        mask=lambda get: CausalMaskConfig(),
        biases=llama_biases,
        fields=_fields,
        qk_norm=True,
        default_head_dim=128,
        gguf=GGUFLayout("qwen3", refuses=refuse_sliding_window),
    ).family()
)
