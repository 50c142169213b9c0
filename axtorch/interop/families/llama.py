"""Llama (1 to 3.x): the plain Llama layout, with optional biases on every projection and no sliding window."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axtorch.interop.families.family import Getter, GGUFLayout
from axtorch.interop.families.llama_layout import (
    LlamaLayout,
    attention_bias_field,
    llama_biases,
    mask_from_layer_types,
    mlp_bias,
    sliding_window,
)
from axtorch.layers.attention_mask import MaskConfig
from axtorch.models.causal_lm import CausalLMConfig


def _mask(get: Getter) -> MaskConfig:
    window = get("sliding_window")
    if window is not None:
        raise ValueError(f"HF config sliding_window={window!r} is not supported for model_type='llama'")
    return mask_from_layer_types(None, get("layer_types"))


def _fields(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    qkv = attention_bias_field(config, require)
    require(sliding_window(config) is None, "a sliding window")
    return {"attention_bias": qkv, "mlp_bias": mlp_bias(config)}


LLAMA = LlamaLayout(
    model_type="llama",
    architecture="LlamaForCausalLM",
    mask=_mask,
    biases=llama_biases,
    fields=_fields,
    # llama.cpp's converter reorders the Q/K rows of Llama files for its interleaved RoPE.
    gguf=GGUFLayout(
        "llama",
        interleaved_qk=True,
        holds=lambda hf: hf.get("sliding_window") is None and not hf.get("num_local_experts"),
    ),
).family()
