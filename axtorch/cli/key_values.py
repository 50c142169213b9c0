"""``key=value`` command-line arguments into a typed config dataclass, checked before any work.

An unknown key is a ``ConfigError`` that suggests the nearest known one; a value of the wrong
type is one that names the key.
"""

from __future__ import annotations

from typing import TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from axtorch.compose.experiment import check_keys_exist
from axtorch.config.errors import ConfigError
from axtorch.config.serialize import to_object

T = TypeVar("T")


def parse_key_values(argv: list[str], schema: type[T]) -> T:
    structured = OmegaConf.structured(schema)
    check_keys_exist(structured, argv)
    try:
        return to_object(OmegaConf.merge(structured, OmegaConf.from_dotlist(argv)), schema)
    except OmegaConfBaseException as error:
        raise ConfigError(
            getattr(error, "full_key", "?") or "?",
            argv,
            "values of the declared types",
            reason=str(error).splitlines()[0],
        ) from error
