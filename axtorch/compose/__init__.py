"""Composing experiments from ``conf/`` with Hydra: the registry of choosable children, strict
overrides, validation, and golden-config snapshots. The top of the stack below the CLIs."""

from axtorch.compose.experiment_loader import compose_experiment_config, load_experiment_config

__all__ = ["compose_experiment_config", "load_experiment_config"]
