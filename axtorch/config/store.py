"""Registers every structured config with Hydra's ConfigStore.

This file is the registry of choosable children: a new implementation of a slot (a feed-forward
block, a norm, a position encoding, a data source) is one ``store`` line here plus its module.
The group name is what users type on the command line (``model/ffn=gelu``); the package is where
the chosen config lands in the experiment tree.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from axtorch.config.schema import TrainConfig
from axtorch.data.sources import (
    HFDatasetSourceConfig,
    JsonlSourceConfig,
    PythonStdlibSourceConfig,
    TextFilesSourceConfig,
)
from axtorch.layers.attention_mask import CausalMaskConfig, SlidingWindowMaskConfig
from axtorch.layers.feed_forward import Activation, GatedFeedForwardConfig, MLPFeedForwardConfig
from axtorch.layers.norm import LayerNormConfig, RMSNormConfig
from axtorch.layers.position import (
    LinearScaledRotaryEmbeddingConfig,
    Llama3RotaryEmbeddingConfig,
    NoPositionConfig,
    RotaryEmbeddingConfig,
    YarnRotaryEmbeddingConfig,
)

SCHEMA_NAME = "train_schema"

#: group -> (package it fills, {option name: config node})
CHOICES = {
    "model/ffn": (
        "model.decoder.layer.feed_forward",
        {
            "swiglu": GatedFeedForwardConfig(activation=Activation.silu),
            "geglu": GatedFeedForwardConfig(activation=Activation.gelu_tanh),
            "gelu": MLPFeedForwardConfig(activation=Activation.gelu),
        },
    ),
    "model/norm": ("model.decoder.layer.norm", {"rmsnorm": RMSNormConfig(), "layernorm": LayerNormConfig()}),
    "model/position": (
        "model.decoder.layer.attention.position",
        {
            "rope": RotaryEmbeddingConfig(),
            "rope_llama3": Llama3RotaryEmbeddingConfig(),
            "rope_linear": LinearScaledRotaryEmbeddingConfig(),
            "rope_yarn": YarnRotaryEmbeddingConfig(),
            "none": NoPositionConfig(),
        },
    ),
    "model/mask": (
        "model.decoder.layer.attention.mask",
        {"causal": CausalMaskConfig(), "sliding_window": SlidingWindowMaskConfig()},
    ),
    # One choice fills both of attention's optional per-head norms (QK-norm), which go together.
    "model/qk_norm": (
        "model.decoder.layer.attention",
        {
            "rmsnorm": {"query_norm": RMSNormConfig(), "key_norm": RMSNormConfig()},
            "none": {"query_norm": None, "key_norm": None},
        },
    ),
    "data/source": (
        "data.source",
        {
            "python_stdlib": PythonStdlibSourceConfig(),
            "text_files": TextFilesSourceConfig(),
            "jsonl": JsonlSourceConfig(),
            "hf_dataset": HFDatasetSourceConfig(),
        },
    ),
}


def register_configs() -> None:
    """Idempotent: safe to call from every entry point and test."""
    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=TrainConfig)
    for group, (package, options) in CHOICES.items():
        for name, node in options.items():
            store.store(group=group, name=name, node=node, package=package)
