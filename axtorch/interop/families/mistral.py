"""Mistral: Llama with one sliding attention window in every layer and no biases."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axtorch.interop.families.family import Getter, GGUFLayout
from axtorch.interop.families.llama_layout import (
    LlamaLayout,
    attention_biases,
    llama_biases,
    mask_from_layer_types,
    mlp_bias,
    sliding_window,
)
from axtorch.layers.attention_mask import MaskConfig
from axtorch.models.causal_lm import CausalLMConfig


def _mask(get: Getter) -> MaskConfig:
    # MistralConfig's default when the field is absent.
    return mask_from_layer_types(get("sliding_window", 4096), get("layer_types"))


def _fields(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    require(not any(attention_biases(config)), "attention biases (it has no attention_bias)")
    require(not mlp_bias(config), "feed-forward biases (it has no mlp_bias)")
    return {"sliding_window": sliding_window(config)}


MISTRAL = LlamaLayout(
    model_type="mistral",
    architecture="MistralForCausalLM",
    mask=_mask,
    biases=llama_biases,
    fields=_fields,
    # llama.cpp runs Mistral as a ``llama`` file; its window, when set, in ``llama.attention.sliding_window``.
    gguf=GGUFLayout(
        "llama",
        interleaved_qk=True,
        config_fields=lambda key: {"sliding_window": key("attention.sliding_window", None)},
        metadata=lambda hf: {"attention.sliding_window": hf["sliding_window"]} if hf["sliding_window"] else {},
        holds=lambda hf: hf.get("sliding_window") is not None and not hf.get("num_local_experts"),
    ),
).family()
