"""The one error type for bad configuration: it always names the key, the value and what is allowed."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """Raised before any compute when a configuration value is invalid.

    The message reads ``<key>=<value>: <reason>; allowed: <allowed>`` so that a user
    can fix the offending override without reading a traceback.
    """

    def __init__(self, key: str, value: Any, allowed: str, reason: str | None = None):
        self.key = key
        self.value = value
        self.allowed = allowed
        detail = f"{key}={value!r}"
        if reason:
            detail += f": {reason}"
        super().__init__(f"invalid config {detail}; allowed: {allowed}")
