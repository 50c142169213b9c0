"""Transformer layer (attention then feed-forward, each on the residual stream) and the decoder stack."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Protocol, overload, runtime_checkable

import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.config.serialize import OMIT_WHEN_EMPTY, to_object
from axtorch.layers.attention import AttentionConfig, AttentionInput
from axtorch.layers.feed_forward import FeedForwardConfig, FeedForwardInput
from axtorch.layers.kv_cache import KVCache
from axtorch.layers.norm import NormConfig
from axtorch.layers.remat import ActivationWidths, RematConfig, combine_widths
from axtorch.layers.residual import ResidualConfig, build_residual, resolved_residual
from axtorch.layers.seams import Seams
from axtorch.layers.shared_values import SharedValues


@dataclass
class TransformerLayerConfig:
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    feed_forward: FeedForwardConfig = MISSING
    #: The norm of each sublayer (attention, feed-forward); ``residual`` decides where it applies.
    norm: NormConfig = MISSING
    #: Norm placement and residual dropout; None means pre-norm without dropout.
    residual: Optional[ResidualConfig] = None

    def validate(self, dim: int, key: str) -> None:
        self.attention.validate(dim, f"{key}.attention")
        self.feed_forward.validate(f"{key}.feed_forward")
        if self.residual is not None:
            self.residual.validate(f"{key}.residual")

    def saved_width(self, dim: int, tensor_parallel: int = 1) -> float:
        """Values per token on one device that the layer's backward keeps without remat: its norms'
        (replicated under tensor parallelism), its attention's and its feed-forward's."""
        norms = 2 * resolved_residual(self.residual).norms_per_sublayer
        return (
            norms * self.norm.saved_width(dim)
            + self.attention.saved_width(dim, tensor_parallel)
            + self.feed_forward.saved_width(dim, tensor_parallel)
        )

    def activation_widths(self, dim: int, tensor_parallel: int = 1) -> ActivationWidths:
        """The activations a layer names for remat (its attention's and its feed-forward's)."""
        return combine_widths(
            self.attention.activation_widths(dim, tensor_parallel),
            self.feed_forward.activation_widths(dim, tensor_parallel),
        )

    def build(self, dim: int) -> TransformerLayer:
        return TransformerLayer(self, dim)


@dataclass
class TransformerLayerInput:
    hidden_states: torch.Tensor  # [B, S, dim]
    positions: torch.Tensor  # [B, S]
    kv_cache: Optional[KVCache] = None
    #: [B, S] document of each token of packed sequences (``AttentionInput.segment_ids``).
    segment_ids: Optional[torch.Tensor] = None
    #: Tables every layer of this forward computes alike (``AttentionInput.shared``), or None.
    shared: Optional[SharedValues] = None


@dataclass
class TransformerLayerOutput:
    hidden_states: torch.Tensor
    kv_cache: Optional[KVCache] = None
    aux_loss: Optional[torch.Tensor] = None


# The native backend shards each layer and the model with FSDP2, which hooks backward onto the
# tensors that need gradients in a sharded module's inputs and outputs; before torch 2.11 it finds
# them only through pytree (an unregistered dataclass is one opaque leaf), hence pytree nodes.
torch.export.register_dataclass(TransformerLayerInput)
torch.export.register_dataclass(TransformerLayerOutput)


class TransformerLayer(nn.Module):
    """Attention then feed-forward, each joined to the residual stream by the norm placement.

    Pre-norm (the default): ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``.
    Each sublayer's norm is this layer's own child (``attention_norm``, ``feed_forward_norm``)
    whatever the placement, so parameter names do not change with it; the placement's module
    (``attention_residual``, ``feed_forward_residual``) applies the norm where it belongs.
    """

    def __init__(self, config: TransformerLayerConfig, dim: int):
        super().__init__()
        self.attention_norm = config.norm.build(dim)
        self.attention = config.attention.build(dim)
        self.attention_residual = build_residual(config.residual, config.norm, dim)
        self.feed_forward_norm = config.norm.build(dim)
        self.feed_forward = config.feed_forward.build(dim)
        self.feed_forward_residual = build_residual(config.residual, config.norm, dim)

    def forward(self, inputs: TransformerLayerInput) -> TransformerLayerOutput:
        h, attention = self.attention_residual(
            inputs.hidden_states,
            self.attention_norm,
            lambda x: self.attention(
                AttentionInput(x, inputs.positions, inputs.kv_cache, inputs.segment_ids, inputs.shared)
            ),
        )
        out, feed_forward = self.feed_forward_residual(
            h, self.feed_forward_norm, lambda x: self.feed_forward(FeedForwardInput(x))
        )
        return TransformerLayerOutput(hidden_states=out, kv_cache=attention.kv_cache, aux_loss=feed_forward.aux_loss)


@dataclass
class DecoderConfig:
    """The decoder stack: ``num_layers`` layers and a final norm.

    A uniform stack repeats ``layer``. A heterogeneous one (Gemma 2/3: five sliding-window
    layers, then one global layer with another RoPE base) names layer ``variants`` and a
    ``pattern`` of their names, repeated cyclically to ``num_layers``. A variant is a partial
    layer tree merged over ``layer``, so it states only what differs from it (a mask, a RoPE
    base, a norm placement), and validation merges it into ``TransformerLayerConfig``'s schema,
    so a misspelt field is a ``ConfigError`` naming its full key. A slot's kind changes with a
    typed node (``SlidingWindowMaskConfig(window=512)`` in Python; from YAML or the command line,
    a config group placed there: ``model/mask@model.decoder.variants.local.attention.mask=sliding_window``).
    Either way parameter names stay ``decoder.layers.{i}....``. ``layer_configs()`` is the one
    resolver that everything walking the layers uses; ``period()`` is the pattern's length, the
    unit a scan over repeated groups steps by.
    """

    num_layers: int = MISSING
    layer: TransformerLayerConfig = field(default_factory=TransformerLayerConfig)
    #: Named partial layer trees merged over ``layer`` (``{local: {attention: {mask: ...}}}``).
    variants: dict[str, Any] = field(default_factory=dict, metadata={OMIT_WHEN_EMPTY: True})
    #: Variant names, repeated cyclically to ``num_layers``; empty means every layer is ``layer``.
    pattern: list[str] = field(default_factory=list, metadata={OMIT_WHEN_EMPTY: True})
    #: Norm after the last layer; None means the same kind as ``layer.norm``.
    final_norm: Optional[NormConfig] = None
    #: Activation checkpointing of each layer (``model/remat``); None keeps every activation.
    remat: Optional[RematConfig] = None
    #: Deprecated, removed in the next release: how the layers run is an execution choice, not the
    #: model's (``execution.layer_runner=scan``). True here sets that, with a warning; nothing
    #: else reads it (it stays, so that the model's digest, and resuming such a run, is unchanged).
    scan_layers: bool = False

    def validate(self, dim: int, key: str) -> None:
        if self.num_layers <= 0:
            raise ConfigError(f"{key}.num_layers", self.num_layers, "a positive integer")
        self.layer.validate(dim, f"{key}.layer")
        for index, name in enumerate(self.pattern):
            if name not in self.variants:
                raise ConfigError(f"{key}.pattern[{index}]", name, f"a name in {key}.variants: {sorted(self.variants)}")
        for name in self.variants:
            if name not in self.pattern:
                raise ConfigError(
                    f"{key}.variants.{name}",
                    self.variants[name],
                    f"a variant that {key}.pattern uses: {sorted(set(self.pattern))}",
                    reason="the pattern never uses it",
                )
            self.variant(name, key).validate(dim, f"{key}.variants.{name}")
        if self.remat is not None:
            widths = [layer.activation_widths(dim) for layer in self.keyed_layer_configs(key).values()]
            self.remat.validate(f"{key}.remat", combine_widths(*widths))

    def variant(self, name: str, key: str = "model.decoder") -> TransformerLayerConfig:
        """``layer`` with variant ``name``'s fields merged over it; ``key`` names this config in errors."""
        overrides = self.variants[name]
        merged = OmegaConf.structured(self.layer)
        try:
            merge_variant(merged, overrides)
        except OmegaConfBaseException as error:  # an unknown field, a wrong type
            field_key = f"{key}.variants.{name}" + (f".{error.full_key}" if error.full_key else "")
            schema = error.object_type if dataclasses.is_dataclass(error.object_type) else TransformerLayerConfig
            allowed = f"the fields of {schema.__name__}: {[f.name for f in dataclasses.fields(schema)]}"
            raise ConfigError(field_key, overrides, allowed, str(error).splitlines()[0]) from error
        return to_object(merged, TransformerLayerConfig)

    def keyed_layer_configs(self, key: str = "model.decoder") -> dict[str, TransformerLayerConfig]:
        """Each distinct layer config under the key that defines it, for checks that name it:
        ``{key}.layer`` for a uniform stack, else ``{key}.variants.<name>`` for each variant."""
        if not self.pattern:
            return {f"{key}.layer": self.layer}
        return {f"{key}.variants.{name}": self.variant(name, key) for name in self.variants}

    def period(self) -> int:
        """How many consecutive layers the pattern repeats: 1 for a uniform stack."""
        return len(self.pattern) or 1

    def layer_configs(self) -> list[TransformerLayerConfig]:
        """Layer ``i``'s config: ``layer``, or variant ``pattern[i % len(pattern)]`` merged over it."""
        if not self.pattern:
            return [self.layer] * self.num_layers
        variants = {name: self.variant(name) for name in set(self.pattern)}
        return [variants[self.pattern[i % len(self.pattern)]] for i in range(self.num_layers)]

    def build(self, dim: int) -> Decoder:
        return Decoder(self, dim)


def merge_variant(base: DictConfig, overrides: Mapping[str, Any]) -> None:
    """Merge a variant's ``overrides`` into ``base`` (a layer config node) in place.

    A plain mapping merges field by field; a typed node (a config dataclass) replaces the child
    whole, which is how a variant changes a slot's kind (a causal mask for a sliding window).
    """
    for name, value in overrides.items():
        child = base._get_node(name)  # None for an unknown field: merge_with raises its error below
        if dataclasses.is_dataclass(value) or (
            isinstance(value, DictConfig) and OmegaConf.get_type(value) not in (None, dict)
        ):
            if child is None:
                base.merge_with({name: value})
            base[name] = value
        elif isinstance(value, Mapping) and isinstance(child, DictConfig):
            merge_variant(child, value)
        else:
            base.merge_with({name: value})


@dataclass
class DecoderInput:
    hidden_states: torch.Tensor  # [B, S, dim]
    positions: torch.Tensor  # [B, S]
    kv_caches: Optional[list[KVCache]] = None
    #: [B, S] document of each token of packed sequences (``AttentionInput.segment_ids``).
    segment_ids: Optional[torch.Tensor] = None


@dataclass
class DecoderOutput:
    hidden_states: torch.Tensor
    kv_caches: Optional[list[KVCache]] = None
    #: Sum of the layers' auxiliary losses, or None when no layer reports one.
    aux_loss: Optional[torch.Tensor] = None


@runtime_checkable
class LayerRunner(Protocol):
    """Runs a decoder's layers on ``inputs`` and returns the last hidden states and the summed
    auxiliary loss (None when no layer reports one).

    Every forward goes through it, a KV-cache decode step too (``inputs.kv_caches``, one cache per
    layer). The default, ``run_layers_unrolled``, runs one layer after another; a backend may fill
    this seam with another, e.g. a compiled scan over stacked weights.
    """

    def __call__(self, decoder: Decoder, inputs: DecoderInput) -> tuple[torch.Tensor, Optional[torch.Tensor]]: ...


class Decoder(nn.Module):
    """A stack of ``num_layers`` layers (``DecoderConfig.layer_configs()``) followed by a final norm."""

    #: What a backend may replace (``axtorch.layers.seams``).
    SEAMS: ClassVar[Seams] = {"layer_runner": LayerRunner}

    def __init__(self, config: DecoderConfig, dim: int):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layer.build(dim) for layer in config.layer_configs())
        self.final_norm = (config.final_norm or config.layer.norm).build(dim)
        self.remat = None if config.remat is None else config.remat.build()
        self.layer_runner: LayerRunner = run_layers_unrolled

    def run_layer(self, layer: nn.Module, inputs: TransformerLayerInput) -> TransformerLayerOutput:
        """One layer, under the remat policy when training.

        A step with a KV cache (decoding) runs without remat: it keeps no activations for a
        backward, so recomputing them would only cost time.
        """
        if self.remat is None or inputs.kv_cache is not None:
            return layer(inputs)
        return self.remat(layer, inputs)

    def forward(self, inputs: DecoderInput) -> DecoderOutput:
        if inputs.kv_caches is not None and len(inputs.kv_caches) != len(self.layers):
            raise ValueError(f"got {len(inputs.kv_caches)} KV caches for {len(self.layers)} layers")
        h, aux_loss = self.layer_runner(self, inputs)
        return DecoderOutput(hidden_states=self.final_norm(h), kv_caches=inputs.kv_caches, aux_loss=aux_loss)


# A running total that is already a tensor stays one (the XLA backend's scan carries it).
@overload
def add_aux_loss(total: torch.Tensor, layer_loss: Optional[torch.Tensor]) -> torch.Tensor: ...
@overload
def add_aux_loss(total: Optional[torch.Tensor], layer_loss: Optional[torch.Tensor]) -> Optional[torch.Tensor]: ...
def add_aux_loss(total: Optional[torch.Tensor], layer_loss: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if layer_loss is None:
        return total
    return layer_loss if total is None else total + layer_loss


def run_layers_unrolled(decoder: Decoder, inputs: DecoderInput) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The default ``LayerRunner``: one layer after another, each with its KV cache if decoding.

    A decoding forward (with KV caches) builds its rotary tables and masks once for all layers
    (``SharedValues``); training keeps each layer's own, so its graph and remat are unchanged.
    A compiled forward keeps them too: the compiler merges the identical computations itself, and
    keys that name tensors by ``id`` would make it recompile at every step.
    """
    caches: list[Optional[KVCache]] = [None] * len(decoder.layers) if inputs.kv_caches is None else [*inputs.kv_caches]
    shared = None if inputs.kv_caches is None or torch.compiler.is_compiling() else SharedValues()
    hidden_states, aux_loss = inputs.hidden_states, None
    for layer, cache in zip(decoder.layers, caches):
        layer_input = TransformerLayerInput(hidden_states, inputs.positions, cache, inputs.segment_ids, shared)
        out = decoder.run_layer(layer, layer_input)
        hidden_states, aux_loss = out.hidden_states, add_aux_loss(aux_loss, out.aux_loss)
    return hidden_states, aux_loss
