"""What every package shares about configs: the one error type and the typed YAML round trip.

This package imports nothing else of axtorch, so any layer may use it; composing experiments
from ``conf/`` with Hydra is ``axtorch.compose``, at the top of the stack.
"""

from axtorch.config.errors import ConfigError

__all__ = ["ConfigError"]
