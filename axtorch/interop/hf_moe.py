"""Hugging Face Mixtral and Qwen3-MoE <-> axtorch's ``MixtureOfExperts``: the expert config and tensors.

Both families are Llama-family models (``hf_llama`` maps their attention, norms and names) whose
every layer's MLP is a mixture of SwiGLU experts; this module holds what differs.

Expert tensors come in three layouts:

- hub checkpoints: one tensor per expert and projection, Mixtral's
  ``model.layers.{i}.block_sparse_moe.experts.{j}.w1|w3|w2.weight`` (gate, up, down) and router
  ``block_sparse_moe.gate.weight``; Qwen3-MoE's ``model.layers.{i}.mlp.experts.{j}.gate_proj|up_proj|down_proj.weight``
  and router ``mlp.gate.weight``. transformers 5 writes this layout by default too.
- transformers 5 in memory, and ``save_pretrained(save_original_format=False)`` on disk:
  ``mlp.experts.gate_up_proj`` [E, 2 * hidden, dim] (gate rows first) and ``mlp.experts.down_proj``
  [E, dim, hidden].
- axtorch: ``experts.gate_proj`` / ``experts.up_proj`` [E, hidden, dim] and ``experts.down_proj``
  [E, dim, hidden].

Import reads either HF layout; export writes the hub layout, which every transformers version
(and other HF-format tools) loads. Between the two, names are *canonical*: transformers 5's
``model.layers.{i}.mlp.gate.weight`` and ``model.layers.{i}.mlp.experts.{gate,up,down}_proj``,
which ``hf_llama``'s rename table (``MOE_NAMES``) maps onto axtorch's.

The router's auxiliary loss is defined differently: HF pools every layer's routing statistics
into one load-balancing loss weighted ``router_aux_loss_coef``; axtorch adds one loss per layer
(``RouterConfig.load_balancing_loss_weight``). With similar routing in every layer the pooled loss
is about one layer's, so the per-layer weight is the coefficient divided by the layer count (and
multiplied back on export). HF has no router z-loss: its weight is not exported, as it does not
change the network's function.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from axtorch.layers.feed_forward import Activation, FeedForwardConfig
from axtorch.layers.mixture_of_experts import Gating, MixtureOfExpertsConfig, RouterConfig
from axtorch.models.causal_lm import CausalLMConfig

#: HF ``model_type`` -> its ``architectures`` entry.
MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE_MODEL_TYPES = tuple(MOE_ARCHITECTURES)

#: (canonical HF name template, axtorch name template), for ``hf_llama``'s rename table. The
#: stacked expert tensors have no ``.weight`` suffix on either side.
MOE_NAMES = [
    ("model.layers.{i}.mlp.gate", "decoder.layers.{i}.feed_forward.router.projection"),
    *(
        (f"model.layers.{{i}}.mlp.experts.{projection}", f"decoder.layers.{{i}}.feed_forward.experts.{projection}")
        for projection in ("gate_proj", "up_proj", "down_proj")
    ),
]

#: Mixtral's per-expert names -> the canonical projection names, and back.
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_TO_MIXTRAL_PROJECTIONS = {ours: theirs for theirs, ours in _MIXTRAL_PROJECTIONS.items()}
_MIXTRAL_BLOCK = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.")
_MIXTRAL_ROUTER = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate\.")
_PER_EXPERT = re.compile(
    r"^(?P<experts>model\.layers\.\d+\.mlp\.experts)\.(?P<index>\d+)\.(?P<projection>\w+)\.weight$"
)
_STACKED = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.experts\.(?P<projection>gate_proj|up_proj|down_proj)$")
_FUSED_GATE_UP = ".mlp.experts.gate_up_proj"


def is_mixture_of_experts(config: CausalLMConfig) -> bool:
    return type(config.decoder.layer.feed_forward) is MixtureOfExpertsConfig


def mixture_of_experts_from_hf(
    get: Callable[..., Any], model_type: str, activation: Activation
) -> MixtureOfExpertsConfig:
    """The feed-forward config of a HF Mixtral or Qwen3-MoE config (read through ``get(key, default)``).

    Defaults are those of transformers' config classes. ``ValueError`` names a field whose value
    axtorch cannot represent.
    """
    if model_type == "mixtral":
        jitter = get("router_jitter_noise", 0.0)
        if jitter:
            raise ValueError(f"HF config router_jitter_noise={jitter!r} is not supported: routing is deterministic")
        num_experts, top_k = get("num_local_experts", 8), get("num_experts_per_tok", 2)
        hidden_dim = get("intermediate_size")
        normalize = True  # Mixtral always renormalises the top-k weights
    else:
        sparse_step = get("decoder_sparse_step", 1)
        if sparse_step != 1:
            raise ValueError(
                f"HF config decoder_sparse_step={sparse_step!r} is not supported: every axtorch layer has the same "
                "feed-forward block, so every layer must be a mixture of experts (decoder_sparse_step=1)"
            )
        dense_layers = get("mlp_only_layers") or []
        if dense_layers:
            raise ValueError(
                f"HF config mlp_only_layers={dense_layers!r} is not supported: every axtorch layer has the same "
                "feed-forward block"
            )
        # config.json from transformers 5 says num_local_experts; the hub's files say num_experts.
        num_experts = get("num_experts") or get("num_local_experts") or 128
        top_k, hidden_dim = get("num_experts_per_tok", 8), get("moe_intermediate_size", 768)
        normalize = bool(get("norm_topk_prob", False))
    return MixtureOfExpertsConfig(
        hidden_dim=hidden_dim,
        activation=activation,
        num_experts=num_experts,
        router=RouterConfig(
            top_k=top_k,
            gating=Gating.softmax,
            normalize_top_k=normalize,
            load_balancing_loss_weight=get("router_aux_loss_coef", 0.001) / get("num_hidden_layers"),
            z_loss_weight=0.0,
        ),
    )


def mixture_of_experts_to_hf(config: CausalLMConfig, model_type: str) -> dict[str, Any]:
    """The ``config.json`` fields of ``config``'s experts as HF ``model_type`` (Mixtral or Qwen3-MoE).

    ``ValueError`` names the first feature that the family cannot express.
    """
    feed_forward = config.decoder.layer.feed_forward
    if not isinstance(feed_forward, MixtureOfExpertsConfig):
        raise TypeError(f"not a mixture of experts: the feed-forward is a {type(feed_forward).__name__}")
    router = feed_forward.router
    unsupported = {
        f"{router.gating.value} gating (they use softmax)": router.gating is not Gating.softmax,
        "a bias on the router": router.projection.bias,
        f"capacity_factor={feed_forward.capacity_factor} (they are dropless)": feed_forward.capacity_factor is not None,
        "shared experts": feed_forward.shared_experts is not None,
        "top-k weights that are not renormalised (Mixtral always renormalises; Qwen3-MoE, which need not, "
        "has QK-norm)": model_type == "mixtral" and not router.normalize_top_k,
        "attention biases (Mixtral has no attention_bias)": model_type == "mixtral"
        and config.decoder.layer.attention.qkv_projection.bias,
    }
    for feature, present in unsupported.items():
        if present:
            raise ValueError(f"HF {MOE_ARCHITECTURES[model_type]} cannot express this model: {feature}")
    coefficient = router.load_balancing_loss_weight * config.decoder.num_layers
    if model_type == "mixtral":
        return {
            "num_local_experts": feed_forward.num_experts,
            "num_experts_per_tok": router.top_k,
            "router_aux_loss_coef": coefficient,
            "router_jitter_noise": 0.0,
        }
    return {
        "num_experts": feed_forward.num_experts,
        "num_experts_per_tok": router.top_k,
        "moe_intermediate_size": feed_forward.hidden_dim,
        "norm_topk_prob": router.normalize_top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": coefficient,
    }


def expert_tensors_from_hf(
    tensors: Iterable[tuple[str, torch.Tensor]], feed_forward: FeedForwardConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors with every expert layout turned canonical; a dense model's pass through unchanged.

    Per-expert tensors are held only until their layer's ``num_experts`` have all arrived, then
    stacked, so at most a layer's experts are held twice (they arrive together in HF's files).
    """
    if type(feed_forward) is not MixtureOfExpertsConfig:
        yield from tensors
        return
    num_experts = feed_forward.num_experts
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors:
        name = _MIXTRAL_BLOCK.sub(r"\1.mlp.", name)
        match = _PER_EXPERT.match(name)
        if match:
            projection = _MIXTRAL_PROJECTIONS.get(match["projection"], match["projection"])
            stacked = f"{match['experts']}.{projection}"
            experts = pending.setdefault(stacked, {})
            experts[int(match["index"])] = tensor
            if len(experts) == num_experts:
                del pending[stacked]
                yield stacked, torch.stack([experts[j] for j in range(num_experts)])
        elif name.endswith(_FUSED_GATE_UP):
            gate, up = tensor.chunk(2, dim=1)
            prefix = name.removesuffix("gate_up_proj")
            yield f"{prefix}gate_proj", gate
            yield f"{prefix}up_proj", up
        else:
            yield name, tensor
    if pending:
        incomplete = {name: sorted(experts) for name, experts in pending.items()}
        raise ValueError(
            f"the checkpoint lacks experts for a model with num_experts={num_experts}: it has only {incomplete}"
        )


def expert_tensors_to_hf(
    tensors: Iterable[tuple[str, torch.Tensor]], model_type: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Canonically named tensors in ``model_type``'s hub layout: stacked experts split into views, one per expert."""
    for name, tensor in tensors:
        if model_type == "mixtral":
            name = _MIXTRAL_ROUTER.sub(r"\1.block_sparse_moe.gate.", name)
        match = _STACKED.match(name)
        if match is None:
            yield name, tensor
            continue
        for index, expert in enumerate(tensor.unbind(0)):
            if model_type == "mixtral":
                projection = _TO_MIXTRAL_PROJECTIONS[match["projection"]]
                yield f"{match['layer']}.block_sparse_moe.experts.{index}.{projection}.weight", expert
            else:
                yield f"{match['layer']}.mlp.experts.{index}.{match['projection']}.weight", expert
