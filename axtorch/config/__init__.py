"""Structured configs: registration with Hydra, validation, and building objects from configs."""

from axtorch.config.errors import ConfigError

__all__ = ["ConfigError"]
