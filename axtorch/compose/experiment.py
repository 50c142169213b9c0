"""Composing ``conf/`` into a validated ``ExperimentConfig``, with errors that name the bad key.

Entry points and tests call ``load_experiment_config(overrides)``; ``axtorch-train`` also runs under
``@hydra.main`` (for multirun and launchers) and uses ``check_overrides`` and ``to_experiment_config``.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Sequence

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from axtorch.config.errors import ConfigError
from axtorch.train.experiment import ExperimentConfig
from axtorch.compose.registry import register_configs

PRIMARY_CONFIG = "train"


def conf_dir() -> Path:
    """The Hydra config root: ``$AXTORCH_CONF_DIR`` or the repository's ``conf/``."""
    path = Path(os.environ.get("AXTORCH_CONF_DIR", Path(__file__).resolve().parents[2] / "conf"))
    if not (path / f"{PRIMARY_CONFIG}.yaml").is_file():
        raise FileNotFoundError(
            f"no {PRIMARY_CONFIG}.yaml under {path}: install axtorch from its repository (pip install -e .) "
            "or point AXTORCH_CONF_DIR at a copy of its conf/ directory"
        )
    return path


def _is_value_override(override: str) -> bool:
    key = override.split("=", 1)[0]
    return "=" in override and "." in key and not key.startswith(("+", "~", "hydra.")) and "/" not in key


def _compose(overrides: Sequence[str]) -> DictConfig:
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(conf_dir()), version_base=None):
        return compose(PRIMARY_CONFIG, overrides=list(overrides))


def check_overrides(overrides: Sequence[str]) -> None:
    """Fail on an override whose key does not exist, listing the keys that do and close matches.

    Group choices (``model=...``, ``model/ffn=...``) are applied first so that keys introduced by
    a chosen child (``data.source.paths`` for ``data/source=text_files``) are known.
    """
    value_overrides = [o for o in overrides if _is_value_override(o)]
    if value_overrides:
        check_keys_exist(_compose([o for o in overrides if not _is_value_override(o)]), value_overrides)


def check_keys_exist(base: DictConfig, overrides: Sequence[str]) -> None:
    """Raise ``ConfigError`` for the first ``key=value`` whose dotted key is not in ``base``."""
    for override in overrides:
        key, _, value = override.partition("=")
        node, walked = base, []
        for part in key.split("."):
            if not isinstance(node, DictConfig) or part not in node.keys():
                parent = ".".join(walked) or "<root>"
                allowed = sorted(node.keys()) if isinstance(node, DictConfig) else []
                close = difflib.get_close_matches(part, allowed, n=1)
                hint = f" (did you mean {'.'.join(walked + close)}?)" if close else ""
                raise ConfigError(key, value, f"keys of {parent}: {allowed}", reason=f"{parent} has no key {part!r}{hint}")
            walked.append(part)
            node = node._get_node(part)


def to_experiment_config(cfg: DictConfig) -> ExperimentConfig:
    """Convert a composed config into typed dataclasses and run the cross-field checks."""
    try:
        config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "<config>"
        raise ConfigError(key, "???", "every required value set", reason=str(error).splitlines()[0]) from error
    config.validate()
    return config


def compose_experiment_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The composed (unvalidated) DictConfig for ``overrides``, as ``axtorch-train`` would see it."""
    check_overrides(overrides)
    try:
        return _compose(overrides)
    except MissingConfigException as error:
        group, _, option = (error.missing_cfg_file or "?/?").rpartition("/")
        raise ConfigError(group, option, f"one of {sorted(error.options or [])}", reason=_first_line(error)) from error
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(_failing_key(error), _failing_value(error, overrides), _allowed(error),
                          reason=_first_line(_root_cause(error))) from error


def load_experiment_config(overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Compose, type-check and validate the experiment config for ``overrides``."""
    return to_experiment_config(compose_experiment_config(overrides))


def _root_cause(error: BaseException) -> BaseException:
    """The innermost OmegaConf error behind a Hydra one (it carries ``full_key``), else ``error``."""
    while error.__cause__ is not None:
        error = error.__cause__
    context = error.__context__
    if not isinstance(error, OmegaConfBaseException) and isinstance(context, OmegaConfBaseException):
        return context  # Hydra re-raises composition errors without chaining them as the cause
    return error


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0]


def _failing_key(error: BaseException) -> str:
    cause = _root_cause(error)
    return getattr(cause, "full_key", None) or "<overrides>"


def _failing_value(error: BaseException, overrides: Sequence[str]) -> str:
    key = _failing_key(error)
    for override in overrides:
        if override.split("=", 1)[0].lstrip("+~") == key:
            return override.split("=", 1)[1] if "=" in override else override
    return "(set by a composed preset)"


def _allowed(error: BaseException) -> str:
    """What the failing key accepts, read off OmegaConf's or Hydra's message."""
    message = _first_line(_root_cause(error))
    if match := re.search(r"Key '(\w+)' not in '(\w+)'", message):
        return f"only the fields of {match.group(2)} (the option chosen for this slot has no {match.group(1)!r})"
    if match := re.search(r"could not be converted to (\w+)", message):
        return f"a value of type {match.group(1)}"
    if match := re.search(r"expected one of (\[.*?\])", message):
        return f"one of {match.group(1)}"
    return message
