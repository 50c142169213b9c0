"""Pre-norm transformer layer and the decoder stack built from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from omegaconf import MISSING
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.layers.attention import AttentionConfig, AttentionInput
from axtorch.layers.feed_forward import FeedForwardConfig, FeedForwardInput
from axtorch.layers.kv_cache import KVCache
from axtorch.layers.norm import NormConfig


@dataclass
class TransformerLayerConfig:
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    feed_forward: FeedForwardConfig = MISSING
    #: Norm applied before attention and before the feed-forward block.
    norm: NormConfig = MISSING

    def validate(self, dim: int, key: str) -> None:
        self.attention.validate(dim, f"{key}.attention")
        self.feed_forward.validate(f"{key}.feed_forward")

    def build(self, dim: int) -> TransformerLayer:
        return TransformerLayer(self, dim)


@dataclass
class TransformerLayerInput:
    hidden_states: torch.Tensor  # [B, S, dim]
    positions: torch.Tensor  # [B, S]
    kv_cache: Optional[KVCache] = None


@dataclass
class TransformerLayerOutput:
    hidden_states: torch.Tensor
    kv_cache: Optional[KVCache] = None
    aux_loss: Optional[torch.Tensor] = None


class TransformerLayer(nn.Module):
    """``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``."""

    def __init__(self, config: TransformerLayerConfig, dim: int):
        super().__init__()
        self.attention_norm = config.norm.build(dim)
        self.attention = config.attention.build(dim)
        self.feed_forward_norm = config.norm.build(dim)
        self.feed_forward = config.feed_forward.build(dim)

    def forward(self, inputs: TransformerLayerInput) -> TransformerLayerOutput:
        attention = self.attention(
            AttentionInput(self.attention_norm(inputs.hidden_states), inputs.positions, inputs.kv_cache)
        )
        h = inputs.hidden_states + attention.hidden_states
        feed_forward = self.feed_forward(FeedForwardInput(self.feed_forward_norm(h)))
        return TransformerLayerOutput(
            hidden_states=h + feed_forward.hidden_states,
            kv_cache=attention.kv_cache,
            aux_loss=feed_forward.aux_loss,
        )


@dataclass
class DecoderConfig:
    num_layers: int = MISSING
    layer: TransformerLayerConfig = field(default_factory=TransformerLayerConfig)
    #: Norm after the last layer; None means the same kind as ``layer.norm``.
    final_norm: Optional[NormConfig] = None

    def validate(self, dim: int, key: str) -> None:
        if self.num_layers <= 0:
            raise ConfigError(f"{key}.num_layers", self.num_layers, "a positive integer")
        self.layer.validate(dim, f"{key}.layer")

    def build(self, dim: int) -> Decoder:
        return Decoder(self, dim)


@dataclass
class DecoderInput:
    hidden_states: torch.Tensor  # [B, S, dim]
    positions: torch.Tensor  # [B, S]
    kv_caches: Optional[list[KVCache]] = None


@dataclass
class DecoderOutput:
    hidden_states: torch.Tensor
    kv_caches: Optional[list[KVCache]] = None
    #: Sum of the layers' auxiliary losses, or None when no layer reports one.
    aux_loss: Optional[torch.Tensor] = None


class Decoder(nn.Module):
    """A stack of ``num_layers`` identical-config layers followed by a final norm."""

    def __init__(self, config: DecoderConfig, dim: int):
        super().__init__()
        self.layers = nn.ModuleList(config.layer.build(dim) for _ in range(config.num_layers))
        self.final_norm = (config.final_norm or config.layer.norm).build(dim)

    def forward(self, inputs: DecoderInput) -> DecoderOutput:
        caches = inputs.kv_caches if inputs.kv_caches is not None else [None] * len(self.layers)
        if len(caches) != len(self.layers):
            raise ValueError(f"got {len(caches)} KV caches for {len(self.layers)} layers")
        h, aux_loss = inputs.hidden_states, None
        for layer, cache in zip(self.layers, caches):
            out = layer(TransformerLayerInput(h, inputs.positions, cache))
            h = out.hidden_states
            if out.aux_loss is not None:
                aux_loss = out.aux_loss if aux_loss is None else aux_loss + out.aux_loss
        return DecoderOutput(hidden_states=self.final_norm(h), kv_caches=inputs.kv_caches, aux_loss=aux_loss)
