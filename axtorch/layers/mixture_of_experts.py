"""Mixture of experts: a feed-forward block in which each token uses only ``top_k`` of ``num_experts`` gated MLPs.

``MixtureOfExpertsConfig`` is a concrete ``FeedForwardConfig``, so it fills a layer's
``feed_forward`` slot (``model/ffn=moe``): ``hidden_dim`` and ``activation`` describe each expert
(SwiGLU experts with ``silu``, as in Mixtral and Qwen3-MoE). Its children are the router
(``RouterConfig``: top-k, gating, auxiliary losses), the routed experts, and optionally experts
that every token uses (``shared_experts``, any feed-forward config, with an optional sigmoid gate
as in Qwen2-MoE).

The routed experts' weights are three stacked tensors, ``experts.gate_proj`` / ``experts.up_proj``
[num_experts, hidden_dim, dim] and ``experts.down_proj`` [num_experts, dim, hidden_dim] (each
expert's slice in ``Linear``'s [out, in] layout), so a sharding rule can split the expert dimension
over the ``expert`` mesh axis without the layer knowing.

Two ways to run the experts:

- dropless (``capacity_factor=None``): the (token, expert) assignments are sorted by expert and
  each expert that received tokens runs once on exactly those rows. Shapes depend on the routing,
  so this is for eager execution (CPU, CUDA); it needs a host sync per layer for the group sizes.
- with a capacity (``capacity_factor`` set): each expert takes at most
  ``ceil(capacity_factor * tokens * top_k / num_experts)`` assignments per call; all experts run as
  one batched matmul over a fixed-shape [num_experts, capacity, dim] buffer, which suits compilers
  that need static shapes (XLA) and expert parallelism. Assignments beyond an expert's capacity are
  dropped, in token order: the earliest tokens of the flattened [batch, sequence] input keep their
  slots, and a dropped assignment contributes nothing (the token keeps its other experts and the
  residual stream).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
import operator
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Protocol, Union, runtime_checkable

import torch
from omegaconf import MISSING
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.layers.eager_parts import EagerReason
from axtorch.layers.feed_forward import (
    Activation,
    FeedForwardConfig,
    FeedForwardInput,
    FeedForwardOutput,
    activate,
)
from axtorch.layers.init import initialize
from axtorch.layers.linear import Linear, LinearConfig
from axtorch.layers.remat import ActivationWidths, activation_name, combine_widths
from axtorch.layers.seams import Seams


class Gating(enum.Enum):
    #: Probabilities over all experts (Mixtral, Qwen3-MoE): the top-k compete with every expert.
    softmax = "softmax"
    #: An independent score in (0, 1) per expert (DeepSeek-V3): experts do not compete.
    sigmoid = "sigmoid"


@dataclass
class RouterConfig:
    """How a token's experts are chosen and weighted, and the losses that keep the choice healthy."""

    top_k: int = 2
    gating: Gating = Gating.softmax
    #: Divide each token's top-k gate values by their sum, so its expert weights add up to 1
    #: (Mixtral always does; Qwen3-MoE's ``norm_topk_prob``).
    normalize_top_k: bool = True
    #: Weight of the load-balancing loss ``num_experts * sum_e f_e * P_e`` (Switch Transformer,
    #: with Mixtral's top-k counting): ``f_e`` is the fraction of tokens that chose expert ``e``
    #: among their top k (the ``f_e`` sum to ``top_k``, so perfectly even routing scores
    #: ``top_k``), ``P_e`` the mean over tokens of ``e``'s gate probability (sigmoid scores are
    #: normalised to sum to 1 first). Each layer adds its own; the decoder sums them.
    load_balancing_loss_weight: float = 0.01
    #: Weight of the router z-loss (ST-MoE): the mean over tokens of ``logsumexp(logits)**2``,
    #: which keeps router logits small enough for low-precision training.
    z_loss_weight: float = 0.0
    #: The [num_experts, dim] projection that scores experts (no bias in Mixtral or Qwen3-MoE).
    projection: LinearConfig = field(default_factory=LinearConfig)

    def validate(self, num_experts: int, key: str) -> None:
        if not 1 <= self.top_k <= num_experts:
            raise ConfigError(f"{key}.top_k", self.top_k, f"an integer in [1, num_experts={num_experts}]")
        for name in ("load_balancing_loss_weight", "z_loss_weight"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{key}.{name}", getattr(self, name), "a non-negative number")

    def build(self, dim: int, num_experts: int) -> Router:
        return Router(self, dim, num_experts)


@dataclass
class RouterOutput:
    weights: torch.Tensor  # [T, top_k] gate values of the chosen experts, highest first
    experts: torch.Tensor  # [T, top_k] int64 indices of the chosen experts
    logits: torch.Tensor  # [T, num_experts] router logits (what HF returns as router_logits)
    #: The weighted sum of the router's losses; None when both weights are 0.
    aux_loss: Optional[torch.Tensor] = None


class Router(nn.Module):
    """Top-k expert choice per token. Scores are computed in at least float32 (as HF does), whatever the input dtype."""

    def __init__(self, config: RouterConfig, dim: int, num_experts: int):
        super().__init__()
        self.config = config
        self.num_experts = num_experts
        self.projection = config.projection.build(dim, num_experts)

    def forward(self, tokens: torch.Tensor) -> RouterOutput:
        """``tokens`` is [T, dim]; ``weights`` come back in the tokens' dtype."""
        config = self.config
        logits = self.projection(tokens).to(torch.promote_types(tokens.dtype, torch.float32))
        scores = logits.softmax(-1) if config.gating is Gating.softmax else logits.sigmoid()
        weights, experts = scores.topk(config.top_k, dim=-1)
        if config.normalize_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        losses: list[torch.Tensor] = []
        if config.load_balancing_loss_weight:
            losses.append(config.load_balancing_loss_weight * self._load_balancing_loss(scores, experts))
        if config.z_loss_weight:
            losses.append(config.z_loss_weight * logits.logsumexp(-1).square().mean())
        aux_loss = functools.reduce(operator.add, losses) if losses else None
        return RouterOutput(weights.to(tokens.dtype), experts, logits, aux_loss)

    def _load_balancing_loss(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        probabilities = scores if self.config.gating is Gating.softmax else scores / scores.sum(-1, keepdim=True)
        chosen = torch.zeros_like(probabilities).scatter_add_(
            1, experts, torch.ones_like(experts, dtype=probabilities.dtype)
        )
        return self.num_experts * (chosen.mean(0) * probabilities.mean(0)).sum()


@dataclass
class MixtureOfExpertsConfig(FeedForwardConfig):
    """Routed gated-MLP experts of width ``hidden_dim`` (plus optional shared experts) in a layer's feed-forward slot.

    ``projection`` / ``output_projection`` give the experts' initialisation (their ``bias`` must
    stay false: experts have none).
    """

    mixes_tokens: ClassVar[bool] = True

    num_experts: int = MISSING
    router: RouterConfig = field(default_factory=RouterConfig)
    #: Assignments each expert takes per forward call, as a multiple of an even share
    #: (``tokens * top_k / num_experts``, rounded up); overflow is dropped in token order. None
    #: is dropless: every assignment is computed (Mixtral, Qwen3-MoE).
    capacity_factor: Optional[float] = None
    #: Experts every token goes through, added to the routed experts' output (Qwen2-MoE,
    #: DeepSeek); None means none.
    shared_experts: Optional[FeedForwardConfig] = None
    #: Scale the shared experts' output per token by the sigmoid of a [1, dim] projection, built
    #: like the router's (Qwen2-MoE's ``shared_expert_gate``). Needs ``shared_experts``.
    shared_expert_gate: bool = False

    def validate(self, key: str) -> None:
        super().validate(key)
        if self.num_experts <= 0:
            raise ConfigError(f"{key}.num_experts", self.num_experts, "a positive integer")
        self.router.validate(self.num_experts, f"{key}.router")
        for name in ("projection", "output_projection"):
            if getattr(self, name).bias:
                raise ConfigError(
                    f"{key}.{name}.bias", True, "false", reason="the stacked expert weights have no biases"
                )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(f"{key}.capacity_factor", self.capacity_factor, "a positive number, or null for dropless")
        if self.shared_experts is not None:
            self.shared_experts.validate(f"{key}.shared_experts")
        elif self.shared_expert_gate:
            raise ConfigError(
                f"{key}.shared_expert_gate",
                True,
                "false without shared_experts",
                reason="there are no shared experts to gate",
            )

    def rows_per_token(self) -> float:
        """Expert rows computed per token: its ``top_k`` assignments, in buffers ``capacity_factor`` as large."""
        return self.router.top_k * (self.capacity_factor or 1.0)

    def saved_width(self, dim: int, tensor_parallel: int = 1) -> float:
        """Per computed assignment a gated expert's four hidden widths and three of the model's (the
        dispatched row, the expert's output, its weighted copy); the router's scores and
        probabilities; the shared experts' own."""
        rows = self.rows_per_token()
        routed = rows * (4 * self.hidden_dim / tensor_parallel + 3 * dim) + 2 * self.num_experts
        shared = 0.0 if self.shared_experts is None else self.shared_experts.saved_width(dim, tensor_parallel)
        return routed + shared

    def expert_parallel_held(self, dim: int, expert: int) -> tuple[float, int]:
        """The rows sent back after the experts ran (kept for the backward), and this process's
        experts' three weights, which ``axtorch.parallel.experts`` gathers whole over the
        data-parallel axes for this layer's forward and again for its backward."""
        rows = self.rows_per_token()
        return rows * dim, self.num_experts // expert * 3 * dim * self.hidden_dim

    def activation_widths(self, dim: int, tensor_parallel: int = 1) -> ActivationWidths:
        """The routed experts' activations (``gated_mlp``) plus the shared experts' own, per token on one device.

        A token's ``top_k`` assignments are computed, each with ``hidden_dim`` hidden features;
        with a capacity, the experts' buffers hold ``capacity_factor`` times as many rows.
        """
        rows = self.rows_per_token()
        routed = {"feed_forward_hidden": rows * self.hidden_dim / tensor_parallel, "feed_forward_output": rows * dim}
        shared = {} if self.shared_experts is None else self.shared_experts.activation_widths(dim, tensor_parallel)
        return combine_widths(routed, shared)

    def build(self, dim: int) -> MixtureOfExperts:
        return MixtureOfExperts(self, dim)


def gated_mlp(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: Activation
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` for [out, in] weights, batched over any leading dims they share with ``x``.

    Every expert computation, local or a backend's, runs here: the names it gives its activations
    are those ``MixtureOfExpertsConfig.activation_widths`` declares.
    """
    with activation_name("feed_forward_hidden"):
        hidden = activate(x @ gate.mT, activation) * (x @ up.mT)
    with activation_name("feed_forward_output"):
        return hidden @ down.mT


class GroupedExperts(nn.Module):
    """``num_experts`` gated MLPs held as stacked weights (see the module docstring for the shapes)."""

    def __init__(self, config: MixtureOfExpertsConfig, dim: int):
        super().__init__()
        self.config = config
        shape = (config.num_experts, config.hidden_dim, dim)
        self.gate_proj = nn.Parameter(torch.empty(shape))
        self.up_proj = nn.Parameter(torch.empty(shape))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, dim, config.hidden_dim))

    def reset_parameters(self) -> None:
        initialize(self.gate_proj, self.config.projection.init)
        initialize(self.up_proj, self.config.projection.init)
        initialize(self.down_proj, self.config.output_projection.init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert on its own rows: [num_experts, rows, dim] -> [num_experts, rows, dim]."""
        return gated_mlp(x, self.gate_proj, self.up_proj, self.down_proj, self.config.activation)

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index`` alone: [rows, dim] -> [rows, dim]."""
        return gated_mlp(x, self.gate_proj[index], self.up_proj[index], self.down_proj[index], self.config.activation)


@runtime_checkable
class ExpertCompute(Protocol):
    """Every expert on its own rows.

    ``rows`` [N, dim] are sorted by expert, ``counts[e]`` of them for expert ``e`` (a tensor;
    dropless routing), or ``counts`` of them for every expert (an int: a capacity's fixed-shape
    buffer); the outputs come back in the same order. A backend that splits the experts over
    processes fills this seam with one that sends rows to their experts' processes and back; the
    default, ``run_local_experts``, runs them all here.
    """

    def __call__(
        self, experts: GroupedExperts, rows: torch.Tensor, counts: Union[torch.Tensor, int]
    ) -> torch.Tensor: ...


_ROUTED_EVENLY: ContextVar[bool] = ContextVar("routed_evenly", default=False)


@contextlib.contextmanager
def routed_evenly() -> Iterator[None]:
    """Expert computes split their rows evenly over the experts, not by the router's counts.

    The dry run's routing: fake tensors have no counts to read. An even split holds the same rows,
    memory and FLOPs in total as any other (each expert's product is linear in its rows); what it
    cannot show is an uneven router's busiest expert, and so an expert-parallel rank's worst peak.
    """
    token = _ROUTED_EVENLY.set(True)
    try:
        yield
    finally:
        _ROUTED_EVENLY.reset(token)


def routing_is_even() -> bool:
    """Whether this is inside ``routed_evenly``."""
    return _ROUTED_EVENLY.get()


def even_counts(rows: int, experts: int) -> list[int]:
    """``rows`` split over ``experts`` as evenly as whole rows allow, the first ones taking the remainder."""
    return [rows // experts + (expert < rows % experts) for expert in range(experts)]


def expert_counts(counts: torch.Tensor, rows: int) -> list[int]:
    """Rows for each expert: the router's ``counts``, read on the host, or an even split under ``routed_evenly``."""
    return even_counts(rows, counts.numel()) if routing_is_even() else counts.tolist()


def run_local_experts(experts: GroupedExperts, rows: torch.Tensor, counts: Union[torch.Tensor, int]) -> torch.Tensor:
    """The default ``ExpertCompute``: every expert here, on this process; a capacity's buffer as one batched matmul."""
    if isinstance(counts, int):  # static shapes, no host read: what XLA needs
        return experts(rows.view(-1, counts, rows.shape[-1])).reshape(rows.shape)
    groups = rows.split(expert_counts(counts, rows.shape[0]))
    return torch.cat([experts.expert(e, group) for e, group in enumerate(groups) if len(group)])


@torch.compiler.disable
def _compute_dropless(
    compute: ExpertCompute, experts: GroupedExperts, rows: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``compute`` run eagerly under torch.compile (``trainer.compile``): each expert's rows are a
    count the router chose, read on the host, so a compiled graph around them would recompile at
    every new count. Outside, the layer's graph keeps its static shapes."""
    return compute(experts, rows, counts)


def _eager_under_compile(module: MixtureOfExperts) -> Optional[str]:
    if module.capacity_factor is not None:
        return None
    return (
        "the dropless mixture of experts runs its experts eagerly (each expert's rows are a count the router "
        "chooses at run time); a capacity (model.decoder.layer.feed_forward.capacity_factor) compiles them"
    )


class MixtureOfExperts(nn.Module):
    """``sum_k weight_k * expert_k(x)`` over each token's routed experts, plus the shared experts if any."""

    #: What a backend may replace (``axtorch.layers.seams``).
    SEAMS: ClassVar[Seams] = {"expert_compute": ExpertCompute}
    #: What stays eager in a compiled layer (``axtorch.layers.eager_parts``).
    EAGER_UNDER_COMPILE: ClassVar[EagerReason] = _eager_under_compile

    def __init__(self, config: MixtureOfExpertsConfig, dim: int):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.router.top_k
        self.capacity_factor = config.capacity_factor
        self.router = config.router.build(dim, config.num_experts)
        self.experts = GroupedExperts(config, dim)
        self.shared_experts = None if config.shared_experts is None else config.shared_experts.build(dim)
        self.shared_expert_gate: Optional[Linear] = (
            config.router.projection.build(dim, 1) if config.shared_expert_gate else None
        )
        self.expert_compute: ExpertCompute = run_local_experts

    def active_parameter_count(self) -> int:
        """Parameters one token multiplies with: everything but the routed experts it does not use.

        The FLOPs-per-token count (``axtorch.train.flops.active_parameters``) asks for this. Dropped
        assignments are not discounted: the count is the nominal ``top_k`` of ``num_experts``.
        """
        routed = sum(p.numel() for p in self.experts.parameters())
        return sum(p.numel() for p in self.parameters()) - routed + routed * self.top_k // self.num_experts

    def capacity(self, num_tokens: int) -> int:
        """Assignments each expert takes when a call routes ``num_tokens`` tokens (needs ``capacity_factor``)."""
        if self.capacity_factor is None:
            raise ValueError("capacity() needs capacity_factor: this layer routes without dropping (dropless)")
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def forward(self, inputs: FeedForwardInput) -> FeedForwardOutput:
        x = inputs.hidden_states
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.router(tokens)
        out = self._dropless(tokens, routing) if self.capacity_factor is None else self._with_capacity(tokens, routing)
        out = out.reshape(x.shape)
        if self.shared_experts is not None:
            shared = self.shared_experts(FeedForwardInput(x)).hidden_states
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return FeedForwardOutput(hidden_states=out, aux_loss=routing.aux_loss)

    def _sorted_assignments(self, routing: RouterOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """The (token, k) assignments, flattened token-major, sorted by expert (token order kept within an expert).

        Returns the permutation and the number of assignments per expert.
        """
        assigned = routing.experts.reshape(-1)
        order = assigned.argsort(stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=assigned.device).scatter_add_(
            0, assigned, torch.ones_like(assigned)
        )
        return order, counts

    def _dropless(self, tokens: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        order, counts = self._sorted_assignments(routing)
        token_of = order // self.top_k  # assignment i in token-major order belongs to token i // top_k
        out = _compute_dropless(self.expert_compute, self.experts, tokens[token_of], counts)
        out = out * routing.weights.reshape(-1)[order, None]
        return torch.zeros_like(tokens).index_add_(0, token_of, out)

    def _with_capacity(self, tokens: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        num_tokens, dim = tokens.shape
        capacity = self.capacity(num_tokens)
        order, counts = self._sorted_assignments(routing)
        assigned = routing.experts.reshape(-1)
        # Rank of each assignment among its expert's, in token order: its slot in that expert's buffer.
        first_of_expert = counts.cumsum(0) - counts
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order), device=order.device) - first_of_expert[assigned[order]]
        kept = rank < capacity
        # Dropped assignments all go to one spare row past the experts' buffers, computed never.
        spare = self.num_experts * capacity
        slot = torch.where(kept, assigned * capacity + rank, spare)
        buffer = tokens.new_zeros(spare + 1, dim).index_add_(0, slot, tokens.repeat_interleave(self.top_k, 0))
        expert_out = self.expert_compute(self.experts, buffer[:spare], capacity)
        gathered = torch.cat([expert_out, expert_out.new_zeros(1, dim)])[slot]
        weights = routing.weights.reshape(-1) * kept
        return (gathered * weights[:, None]).view(num_tokens, self.top_k, dim).sum(1)
