"""Presets composed as the trainer composes them and built on the meta device: shapes only, seconds even for 405B."""

import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.models.causal_lm import CausalLM
from axtorch.train.experiment import ExperimentConfig


def build_on_meta(*overrides: str) -> tuple[ExperimentConfig, CausalLM]:
    config = load_experiment_config(list(overrides))
    with torch.device("meta"):
        return config, config.model.build()
