"""Mixtral: Mistral whose every MLP is a mixture of SwiGLU experts, with its own tensor names.

Mixtral's hub checkpoints name the experts ``block_sparse_moe.experts.{j}.w1|w3|w2`` (gate, up,
down) and the router ``block_sparse_moe.gate``; it always renormalises the top-k weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from axtorch.interop.families.experts import (
    ExpertFormat,
    aux_loss_coefficient,
    moe_config,
    no_shared_experts,
    routed_experts,
)
from axtorch.interop.families.family import Getter, GGUFLayout
from axtorch.interop.families.llama_layout import (
    LlamaLayout,
    attention_biases,
    llama_biases,
    mask_from_layer_types,
    sliding_window,
)
from axtorch.layers.feed_forward import Activation
from axtorch.layers.mixture_of_experts import MixtureOfExpertsConfig
from axtorch.models.causal_lm import CausalLMConfig

_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_HUB_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_HUB_ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.")
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight$")
_ROUTER = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate\.")


def _to_canonical(name: str) -> str:
    expert = _HUB_EXPERT.match(name)
    if expert:
        return f"{expert[1]}.mlp.experts.{expert[2]}.{_PROJECTIONS[expert[3]]}.weight"
    return _HUB_ROUTER.sub(r"\1.mlp.gate.", name)


def _from_canonical(name: str) -> str:
    expert = _EXPERT.match(name)
    if expert:
        hub = {ours: theirs for theirs, ours in _PROJECTIONS.items()}[expert[3]]
        return f"{expert[1]}.block_sparse_moe.experts.{expert[2]}.{hub}.weight"
    return _ROUTER.sub(r"\1.block_sparse_moe.gate.", name)


def _read(get: Getter, activation: Activation) -> MixtureOfExpertsConfig:
    jitter = get("router_jitter_noise", 0.0)
    if jitter:
        raise ValueError(f"HF config router_jitter_noise={jitter!r} is not supported: routing is deterministic")
    return moe_config(
        get,
        activation,
        num_experts=get("num_local_experts", 8),
        top_k=get("num_experts_per_tok", 2),
        hidden_dim=get("intermediate_size"),
        normalize=True,
    )


def _write(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    experts = routed_experts(config, require)
    no_shared_experts(experts, require)
    require(experts.router.normalize_top_k, "top-k weights that are not renormalised (it always renormalises)")
    return {
        "num_local_experts": experts.num_experts,
        "num_experts_per_tok": experts.router.top_k,
        "router_aux_loss_coef": aux_loss_coefficient(config, experts),
        "router_jitter_noise": 0.0,
    }


def _fields(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
    require(not any(attention_biases(config)), "attention biases (it has no attention_bias)")
    return {"sliding_window": sliding_window(config)}


MIXTRAL = LlamaLayout(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    mask=lambda get: mask_from_layer_types(get("sliding_window"), get("layer_types")),
    biases=llama_biases,
    fields=_fields,
    experts=ExpertFormat(read=_read, write=_write, to_canonical=_to_canonical, from_canonical=_from_canonical),
    # llama.cpp runs Mixtral as a ``llama`` file with experts.
    gguf=GGUFLayout(
        "llama",
        interleaved_qk=True,
        config_fields=lambda key: {
            "num_local_experts": key("expert_count", 0),
            "num_experts_per_tok": key("expert_used_count", 0),
            "sliding_window": key("attention.sliding_window", None),
        },
        metadata=lambda hf: {
            "expert_count": hf["num_local_experts"],
            "expert_used_count": hf["num_experts_per_tok"],
            **({"attention.sliding_window": hf["sliding_window"]} if hf["sliding_window"] else {}),
        },
        holds=lambda hf: bool(hf.get("num_local_experts")),
    ),
).family()
