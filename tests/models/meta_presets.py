"""Presets composed as the trainer composes them and built on the meta device: shapes only, seconds even for 405B."""

import torch

from axtorch.config.compose import load_train_config
from axtorch.config.schema import TrainConfig
from axtorch.models.causal_lm import CausalLM


def build_on_meta(*overrides: str) -> tuple[TrainConfig, CausalLM]:
    config = load_train_config(list(overrides))
    with torch.device("meta"):
        return config, config.model.build()
