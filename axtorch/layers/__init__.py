"""Layers: each an ``nn.Module`` built from its own config dataclass (``config.build(...)``)."""

from axtorch.layers.attention import AttentionConfig, AttentionInput, AttentionOutput, GroupedQueryAttention
from axtorch.layers.attention_mask import CausalMask, CausalMaskConfig, MaskConfig, SlidingWindowMask, SlidingWindowMaskConfig
from axtorch.layers.embedding import Embedding, EmbeddingConfig
from axtorch.layers.feed_forward import (
    Activation,
    FeedForward,
    FeedForwardConfig,
    FeedForwardInput,
    FeedForwardOutput,
    GatedFeedForward,
    GatedFeedForwardConfig,
    MLPFeedForwardConfig,
)
from axtorch.layers.init import InitConfig, InitScheme
from axtorch.layers.kv_cache import KVCache
from axtorch.layers.linear import Linear, LinearConfig
from axtorch.layers.norm import LayerNorm, LayerNormConfig, NormConfig, RMSNorm, RMSNormConfig
from axtorch.layers.position import (
    LinearScaledRotaryEmbeddingConfig,
    Llama3RotaryEmbeddingConfig,
    NoPosition,
    NoPositionConfig,
    PositionConfig,
    RotaryEmbedding,
    RotaryEmbeddingConfig,
    YarnRotaryEmbeddingConfig,
)
from axtorch.layers.transformer import (
    Decoder,
    DecoderConfig,
    DecoderInput,
    DecoderOutput,
    TransformerLayer,
    TransformerLayerConfig,
    TransformerLayerInput,
    TransformerLayerOutput,
)

__all__ = [
    "Activation",
    "AttentionConfig",
    "AttentionInput",
    "AttentionOutput",
    "CausalMask",
    "CausalMaskConfig",
    "Decoder",
    "DecoderConfig",
    "DecoderInput",
    "DecoderOutput",
    "Embedding",
    "EmbeddingConfig",
    "FeedForward",
    "FeedForwardConfig",
    "FeedForwardInput",
    "FeedForwardOutput",
    "GatedFeedForward",
    "GatedFeedForwardConfig",
    "GroupedQueryAttention",
    "InitConfig",
    "InitScheme",
    "KVCache",
    "LayerNorm",
    "LinearScaledRotaryEmbeddingConfig",
    "Llama3RotaryEmbeddingConfig",
    "LayerNormConfig",
    "Linear",
    "LinearConfig",
    "MLPFeedForwardConfig",
    "MaskConfig",
    "NoPosition",
    "NoPositionConfig",
    "NormConfig",
    "PositionConfig",
    "RMSNorm",
    "RMSNormConfig",
    "RotaryEmbedding",
    "RotaryEmbeddingConfig",
    "SlidingWindowMask",
    "SlidingWindowMaskConfig",
    "TransformerLayer",
    "TransformerLayerConfig",
    "TransformerLayerInput",
    "TransformerLayerOutput",
    "YarnRotaryEmbeddingConfig",
]
