"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 whose every MLP is routed SwiGLU experts plus
one shared expert that every token uses, scaled per token by a sigmoid gate. Its sliding window
(``use_sliding_window``) is in the layers ``layer_types`` names, by default alternate layers before
``max_window_layers``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axtorch.interop.families.experts import (
    ExpertFormat,
    aux_loss_coefficient,
    every_layer_sparse,
    gated_shared_expert,
    gguf_expert_fields,
    gguf_expert_metadata,
    moe_config,
    routed_experts,
)
from axtorch.interop.families.family import Getter, GGUFLayout
from axtorch.interop.families.layer_types import refuse_sliding_window, with_qwen_windows
from axtorch.interop.families.llama_layout import LlamaLayout, attention_biases, dense_feed_forward
from axtorch.layers.attention_mask import CausalMaskConfig
from axtorch.layers.feed_forward import Activation
from axtorch.layers.mixture_of_experts import MixtureOfExpertsConfig
from axtorch.models.causal_lm import CausalLMConfig


def _read(get: Getter, activation: Activation) -> MixtureOfExpertsConfig:
    every_layer_sparse(get)
    shared = dense_feed_forward(get("shared_expert_intermediate_size", 5632), activation, bias=False)
    return moe_config(
        get,
        activation,
        num_experts=get("num_experts", 60),
        top_k=get("num_experts_per_tok", 4),
        hidden_dim=get("moe_intermediate_size", 1408),
        normalize=bool(get("norm_topk_prob", False)),
        shared_experts=shared,
    )


def _write(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    experts = routed_experts(config, require)
    shared_width = gated_shared_expert(experts, require)
    return {
        "num_experts": experts.num_experts,
        "num_experts_per_tok": experts.router.top_k,
        "moe_intermediate_size": experts.hidden_dim,
        "shared_expert_intermediate_size": shared_width,
        "norm_topk_prob": experts.router.normalize_top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": aux_loss_coefficient(config, experts),
    }


def _slides(layer: int, max_window_layers: int) -> bool:
    """Qwen2-MoE's rule (transformers' ``Qwen2MoeConfig``): alternate layers before ``max_window_layers`` slide."""
    return layer % 2 == 0 and layer < max_window_layers


def _fields(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    qkv, output = attention_biases(config)
    require(not output, "a bias on the attention output projection")
    return {"qkv_bias": qkv}


QWEN2_MOE = with_qwen_windows(
    LlamaLayout(
        model_type="qwen2_moe",
        architecture="Qwen2MoeForCausalLM",
        mask=lambda get: CausalMaskConfig(),
        biases=lambda get: (bool(get("qkv_bias", True)), False, False),
        fields=_fields,
        experts=ExpertFormat(read=_read, write=_write),
        # llama.cpp does not renormalise Qwen2-MoE's top-k weights, as the released models do not.
        gguf=GGUFLayout(
            "qwen2moe",
            config_fields=lambda key: {
                **gguf_expert_fields(key),
                "shared_expert_intermediate_size": key("expert_shared_feed_forward_length"),
                "norm_topk_prob": False,
            },
            metadata=lambda hf: {
                **gguf_expert_metadata(hf),
                "expert_shared_feed_forward_length": hf["shared_expert_intermediate_size"],
            },
            refuses=lambda hf: "renormalised top-k weights" if hf["norm_topk_prob"] else refuse_sliding_window(hf),
        ),
    ).family(),
    slides=_slides,
)
