"""Qwen3-MoE: Qwen3 whose every MLP is a mixture of SwiGLU experts (head size dim / heads by default)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axtorch.interop.families.experts import (
    ExpertFormat,
    aux_loss_coefficient,
    every_layer_sparse,
    gguf_expert_fields,
    gguf_expert_metadata,
    moe_config,
    no_shared_experts,
    routed_experts,
)
from axtorch.interop.families.family import Getter, GGUFLayout
from axtorch.interop.families.layer_types import refuse_sliding_window
from axtorch.interop.families.llama_layout import (
    LlamaLayout,
    attention_bias_field,
    llama_biases,
    mask_from_layer_types,
    sliding_window,
)
from axtorch.layers.attention_mask import MaskConfig
from axtorch.layers.feed_forward import Activation
from axtorch.layers.mixture_of_experts import MixtureOfExpertsConfig
from axtorch.models.causal_lm import CausalLMConfig


def _read(get: Getter, activation: Activation) -> MixtureOfExpertsConfig:
    every_layer_sparse(get)
    return moe_config(
        get,
        activation,
        # config.json from transformers 5 says num_local_experts; the hub's files say num_experts.
        num_experts=get("num_experts") or get("num_local_experts") or 128,
        top_k=get("num_experts_per_tok", 8),
        hidden_dim=get("moe_intermediate_size", 768),
        normalize=bool(get("norm_topk_prob", False)),
    )


def _write(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    experts = routed_experts(config, require)
    no_shared_experts(experts, require)
    return {
        "num_experts": experts.num_experts,
        "num_experts_per_tok": experts.router.top_k,
        "moe_intermediate_size": experts.hidden_dim,
        "norm_topk_prob": experts.router.normalize_top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": aux_loss_coefficient(config, experts),
    }


def _mask(get: Getter) -> MaskConfig:
    # Unlike Qwen3, every layer slides when use_sliding_window is set: transformers' Qwen3-MoE reads
    # neither max_window_layers nor layer_types.
    return mask_from_layer_types(get("sliding_window", 4096) if get("use_sliding_window", False) else None, None)


def _fields(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    window = sliding_window(config)
    return {
        "attention_bias": attention_bias_field(config, require),
        "use_sliding_window": window is not None,
        "sliding_window": window,
    }


QWEN3_MOE = LlamaLayout(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    mask=_mask,
    biases=llama_biases,
    fields=_fields,
    qk_norm=True,
    experts=ExpertFormat(read=_read, write=_write),
    # llama.cpp always renormalises Qwen3-MoE's top-k weights, as the released models do.
    gguf=GGUFLayout(
        "qwen3moe",
        config_fields=lambda key: {**gguf_expert_fields(key), "norm_topk_prob": True},
        metadata=gguf_expert_metadata,
        refuses=lambda hf: (
            refuse_sliding_window(hf) if hf["norm_topk_prob"] else "top-k weights that are not renormalised"
        ),
    ),
).family()
