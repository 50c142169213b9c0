"""Mixture-of-experts tensors and config fields shared by the HF families whose every MLP is one.

Expert tensors come in three layouts:

- hub checkpoints: one tensor per expert and projection, e.g.
  ``model.layers.{i}.mlp.experts.{j}.gate_proj.weight`` and the router ``mlp.gate.weight``
  (a family may name them its own way: ``ExpertFormat.to_canonical``). transformers 5 writes
  this layout by default too.
- transformers 5 in memory, and ``save_pretrained(save_original_format=False)`` on disk:
  ``mlp.experts.gate_up_proj`` [E, 2 * hidden, dim] (gate rows first) and ``mlp.experts.down_proj``
  [E, dim, hidden].
- axtorch: ``experts.gate_proj`` / ``experts.up_proj`` [E, hidden, dim] and ``experts.down_proj``
  [E, dim, hidden].

Import reads either HF layout; export writes the hub layout, which every transformers version
(and other HF-format tools) loads. Between the two, names are *canonical*: transformers 5's
``model.layers.{i}.mlp.gate.weight`` and ``model.layers.{i}.mlp.experts.{gate,up,down}_proj``.

The router's auxiliary loss is defined differently: HF pools every layer's routing statistics
into one load-balancing loss weighted ``router_aux_loss_coef``; axtorch adds one loss per layer
(``RouterConfig.load_balancing_loss_weight``). With similar routing in every layer the pooled loss
is about one layer's, so the per-layer weight is the coefficient divided by the layer count (and
multiplied back on export). HF has no router z-loss: its weight is not exported, as it does not
change the network's function.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from axtorch.interop.families.family import Getter, NamedTensor
from axtorch.layers.feed_forward import Activation, FeedForwardConfig, GatedFeedForwardConfig
from axtorch.layers.mixture_of_experts import Gating, MixtureOfExpertsConfig, RouterConfig
from axtorch.models.causal_lm import CausalLMConfig

#: (canonical HF name template, axtorch name template), for the Llama layout's rename table. The
#: stacked expert tensors have no ``.weight`` suffix on either side.
CANONICAL_EXPERT_NAMES = [
    ("model.layers.{i}.mlp.gate", "decoder.layers.{i}.feed_forward.router.projection"),
    *(
        (f"model.layers.{{i}}.mlp.experts.{projection}", f"decoder.layers.{{i}}.feed_forward.experts.{projection}")
        for projection in ("gate_proj", "up_proj", "down_proj")
    ),
    *(
        (
            f"model.layers.{{i}}.mlp.shared_expert.{projection}",
            f"decoder.layers.{{i}}.feed_forward.shared_experts.{projection}",
        )
        for projection in ("gate_proj", "up_proj", "down_proj")
    ),
    ("model.layers.{i}.mlp.shared_expert_gate", "decoder.layers.{i}.feed_forward.shared_expert_gate"),
]

_PER_EXPERT = re.compile(
    r"^(?P<experts>model\.layers\.\d+\.mlp\.experts)\.(?P<index>\d+)\.(?P<projection>\w+)\.weight$"
)
_STACKED = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.experts\.(?P<projection>gate_proj|up_proj|down_proj)$")
_FUSED_GATE_UP = ".mlp.experts.gate_up_proj"


def _same(name: str) -> str:
    return name


@dataclass(frozen=True)
class ExpertFormat:
    """What a mixture-of-experts family's HF config and hub names say about its experts."""

    #: The feed-forward config from the family's HF config: ``read(get, activation)``.
    read: Callable[[Getter, Activation], MixtureOfExpertsConfig]
    #: The family's expert fields of ``config.json``: ``write(config, require)``.
    write: Callable[[CausalLMConfig, Callable[[bool, str], None]], dict[str, Any]]
    #: A hub tensor name -> its canonical name (per expert: ``mlp.experts.{j}.gate_proj.weight``).
    to_canonical: Callable[[str], str] = _same
    #: The inverse, on canonical per-expert and router names.
    from_canonical: Callable[[str], str] = _same


def moe_config(
    get: Getter,
    activation: Activation,
    num_experts: int,
    top_k: int,
    hidden_dim: int,
    normalize: bool,
    shared_experts: FeedForwardConfig | None = None,
) -> MixtureOfExpertsConfig:
    """Routed SwiGLU experts with softmax gating, as HF's MoE families have them."""
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
        shared_experts=shared_experts,
        shared_expert_gate=shared_experts is not None,
    )


def every_layer_sparse(get: Getter) -> None:
    """Refuse HF configs with dense layers between the sparse ones: every axtorch layer is alike."""
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


def routed_experts(config: CausalLMConfig, require: Callable[[bool, str], None]) -> MixtureOfExpertsConfig:
    """The model's experts, refusing what no HF MoE family has; ``require`` raises naming the feature."""
    feed_forward = config.decoder.layer.feed_forward
    require(
        type(feed_forward) is MixtureOfExpertsConfig,
        f"feed-forward {type(feed_forward).__name__} (every layer's MLP is a mixture of experts)",
    )
    assert isinstance(feed_forward, MixtureOfExpertsConfig)
    router = feed_forward.router
    require(router.gating is Gating.softmax, f"{router.gating.value} gating (it uses softmax)")
    require(not router.projection.bias, "a bias on the router")
    require(feed_forward.capacity_factor is None, f"capacity_factor={feed_forward.capacity_factor} (it is dropless)")
    return feed_forward


def aux_loss_coefficient(config: CausalLMConfig, experts: MixtureOfExpertsConfig) -> float:
    return experts.router.load_balancing_loss_weight * config.decoder.num_layers


def no_shared_experts(experts: MixtureOfExpertsConfig, require: Callable[[bool, str], None]) -> None:
    require(experts.shared_experts is None, "shared experts")


def gated_shared_expert(experts: MixtureOfExpertsConfig, require: Callable[[bool, str], None]) -> int:
    """The width of the one sigmoid-gated SwiGLU shared expert a model must have (Qwen2-MoE's)."""
    shared = experts.shared_experts
    require(
        type(shared) is GatedFeedForwardConfig
        and experts.shared_expert_gate
        and shared.activation is experts.activation
        and not shared.projection.bias
        and not shared.output_projection.bias,
        f"shared experts {shared} with shared_expert_gate={experts.shared_expert_gate} (it has one "
        "sigmoid-gated gated MLP without biases, with the experts' activation)",
    )
    assert isinstance(shared, GatedFeedForwardConfig)
    return shared.hidden_dim


def gguf_expert_fields(key: Getter) -> dict[str, Any]:
    """The routed experts' HF fields from llama.cpp's ``<architecture>.expert_*`` metadata (``key(name)``)."""
    return {
        "num_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
    }


def gguf_expert_metadata(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of ``gguf_expert_fields``."""
    return {
        "expert_count": hf["num_experts"],
        "expert_used_count": hf["num_experts_per_tok"],
        "expert_feed_forward_length": hf["moe_intermediate_size"],
    }


def stack_experts(
    tensors: Iterable[NamedTensor], feed_forward: FeedForwardConfig, expert_format: ExpertFormat
) -> Iterator[NamedTensor]:
    """HF-named tensors with every expert layout turned canonical.

    Per-expert tensors are held only until their layer's ``num_experts`` have all arrived, then
    stacked, so at most a layer's experts are held twice (they arrive together in HF's files).
    """
    assert isinstance(feed_forward, MixtureOfExpertsConfig)
    num_experts = feed_forward.num_experts
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors:
        name = expert_format.to_canonical(name)
        match = _PER_EXPERT.match(name)
        if match:
            stacked = f"{match['experts']}.{match['projection']}"
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


def unstack_experts(tensors: Iterable[NamedTensor], expert_format: ExpertFormat) -> Iterator[NamedTensor]:
    """Canonically named tensors in the family's hub layout: stacked experts split into views, one per expert."""
    for name, tensor in tensors:
        match = _STACKED.match(name)
        if match is None:
            yield expert_format.from_canonical(name), tensor
            continue
        for index, expert in enumerate(tensor.unbind(0)):
            canonical = f"{match['layer']}.mlp.experts.{index}.{match['projection']}.weight"
            yield expert_format.from_canonical(canonical), expert
