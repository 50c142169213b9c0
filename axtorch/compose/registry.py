"""Registers every structured config with Hydra's ConfigStore.

This file is the registry of choosable children: a new implementation of a slot (a feed-forward
block, a norm, a position encoding, a data source) is one ``store`` line here plus its module.
The group name is what users type on the command line (``model/ffn=gelu``); the package is where
the chosen config lands in the experiment tree.
"""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from axtorch.config.errors import ConfigError
from axtorch.data.chat import ChatSourceConfig
from axtorch.data.parquet import ParquetSourceConfig
from axtorch.data.shards import TokenizedSourceConfig
from axtorch.data.sources import (
    HFDatasetSourceConfig,
    JsonlSourceConfig,
    PythonStdlibSourceConfig,
    SourceConfig,
    TextFilesSourceConfig,
)
from axtorch.layers.attention_kernel import SoftcappedKernelConfig
from axtorch.layers.attention_mask import CausalMaskConfig, SlidingWindowMaskConfig
from axtorch.layers.feed_forward import Activation, GatedFeedForwardConfig, MLPFeedForwardConfig
from axtorch.layers.mixture_of_experts import MixtureOfExpertsConfig
from axtorch.layers.norm import LayerNormConfig, RMSNormConfig
from axtorch.layers.position_embedding import LearnedPositionEmbeddingConfig
from axtorch.layers.relative_position import (
    AlibiConfig,
    LinearScaledRotaryEmbeddingConfig,
    Llama3RotaryEmbeddingConfig,
    NoPositionConfig,
    RotaryEmbeddingConfig,
    YarnRotaryEmbeddingConfig,
)
from axtorch.layers.remat import FullRematConfig, SelectiveRematConfig
from axtorch.layers.residual import PostNormResidualConfig, PreNormResidualConfig, SandwichNormResidualConfig
from axtorch.models.float8 import RowwiseFloat8Config, TensorwiseFloat8Config
from axtorch.models.frozen_base import Int8FrozenBaseConfig
from axtorch.models.lora import LoRAConfig
from axtorch.train.experiment import ExperimentConfig

SCHEMA_NAME = "train_schema"

#: group -> (package it fills, {option name: config node})
CHOICES: dict[str, tuple[str, dict[str, Any]]] = {
    "model/ffn": (
        "model.decoder.layer.feed_forward",
        {
            "swiglu": GatedFeedForwardConfig(activation=Activation.silu),
            "geglu": GatedFeedForwardConfig(activation=Activation.gelu_tanh),
            "gelu": MLPFeedForwardConfig(activation=Activation.gelu),
            "moe": MixtureOfExpertsConfig(activation=Activation.silu),
        },
    ),
    # Experts that every token of a mixture-of-experts layer uses (choose after model/ffn=moe).
    "model/shared_experts": (
        "model.decoder.layer.feed_forward",
        {
            "swiglu": {"shared_experts": GatedFeedForwardConfig(activation=Activation.silu)},
            "none": {"shared_experts": None},
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
            "alibi": AlibiConfig(),
        },
    ),
    "model/mask": (
        "model.decoder.layer.attention.mask",
        {"causal": CausalMaskConfig(), "sliding_window": SlidingWindowMaskConfig()},
    ),
    # How attention turns scores into outputs; sdpa is the default (kernel None).
    "model/attention_kernel": (
        "model.decoder.layer.attention",
        {"sdpa": {"kernel": None}, "softcapped": {"kernel": SoftcappedKernelConfig()}},
    ),
    "model/norm_placement": (
        "model.decoder.layer.residual",
        {"pre": PreNormResidualConfig(), "post": PostNormResidualConfig(), "sandwich": SandwichNormResidualConfig()},
    ),
    # One choice fills both of attention's optional per-head norms (QK-norm), which go together.
    "model/qk_norm": (
        "model.decoder.layer.attention",
        {
            "rmsnorm": {"query_norm": RMSNormConfig(), "key_norm": RMSNormConfig()},
            "none": {"query_norm": None, "key_norm": None},
        },
    ),
    # Absolute positions added to the token embeddings (GPT-2), beside or instead of model/position.
    "model/position_embedding": (
        "model",
        {
            "learned": {"position_embedding": LearnedPositionEmbeddingConfig()},
            "none": {"position_embedding": None},
        },
    ),
    # Activation checkpointing of each decoder layer; no choice (or none) keeps every activation.
    "model/remat": (
        "model.decoder",
        {
            "none": {"remat": None},
            "full": {"remat": FullRematConfig()},
            "selective": {"remat": SelectiveRematConfig()},
        },
    ),
    # Float8 matmuls in the linears (torchao), applied by the trainer from outside the layers.
    "model/float8": (
        "model",
        {
            "none": {"float8": None},
            "tensorwise": {"float8": TensorwiseFloat8Config()},
            "rowwise": {"float8": RowwiseFloat8Config()},
        },
    ),
    # Adapters on a frozen model (LoRA), applied by the trainer from outside the layers.
    "model/adapter": ("model", {"none": {"adapter": None}, "lora": {"adapter": LoRAConfig()}}),
    # The frozen base's stored format while adapters train (int8: a quarter of its linears' bytes).
    "model/frozen_base": ("model", {"none": {"frozen_base": None}, "int8": {"frozen_base": Int8FrozenBaseConfig()}}),
    "data/source": (
        "data.source",
        {
            "python_stdlib": PythonStdlibSourceConfig(),
            "text_files": TextFilesSourceConfig(),
            "jsonl": JsonlSourceConfig(),
            "hf_dataset": HFDatasetSourceConfig(),
            "parquet": ParquetSourceConfig(),
            "tokenized": TokenizedSourceConfig(),
            "chat": ChatSourceConfig(),
        },
    ),
}


def register_configs() -> None:
    """Idempotent: safe to call from every entry point and test."""
    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=ExperimentConfig)
    for group, (package, options) in CHOICES.items():
        for name, node in options.items():
            store.store(group=group, name=name, node=node, package=package)


def resolve_mixture_sources(composed: DictConfig) -> None:
    """Give each ``data.mixture`` entry written as ``{kind: <a data/source option>, ...}`` that option's typed node.

    A list entry cannot be filled by a config group as ``data.source`` is, so the option is named
    inside it; entries that are already typed are left as they are.
    """
    options = CHOICES["data/source"][1]
    for index, entry in enumerate(composed.data.get("mixture") or []):
        source = entry.source
        if not isinstance(source, DictConfig) or issubclass(OmegaConf.get_type(source) or dict, SourceConfig):
            continue
        key = f"data.mixture[{index}].source.kind"
        kind = source.get("kind")
        if kind not in options:
            raise ConfigError(key, kind, f"one of the data/source options {sorted(options)}")
        fields = {name: value for name, value in source.items() if name != "kind"}
        try:
            entry.source = OmegaConf.merge(OmegaConf.structured(options[kind]), fields)
        except OmegaConfBaseException as error:  # an unknown field, a wrong type
            raise ConfigError(
                f"data.mixture[{index}].source", dict(fields), f"the fields of {kind}", str(error).splitlines()[0]
            ) from error
