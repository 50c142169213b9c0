"""Composing ``conf/`` into a validated ``ExperimentConfig``, with errors that name the bad key.

The YAML groups are the installed package ``axtorch.conf``; users' own directories join the search
path after it. Entry points and tests call ``load_experiment_config(overrides)``; ``axtorch-train``
also runs under ``@hydra.main`` (for multirun and launchers) and uses ``check_overrides`` and
``to_experiment_config``.
"""

from __future__ import annotations

import difflib
import functools
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, Node, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from axtorch.compose.model_from_init import default_model_choice, takes_model_from_file, with_model_from_file
from axtorch.compose.registry import register_configs, resolve_mixture_sources
from axtorch.config.errors import ConfigError
from axtorch.config.serialize import to_object
from axtorch.parallel.hardware import detect_hardware_id
from axtorch.parallel.mesh_rules import select_rule
from axtorch.parallel.sharding import auto_sharding_preset
from axtorch.train.experiment import ExperimentConfig

#: The installed package that holds ``conf/`` (setuptools maps the repository's ``conf/`` to it).
CONFIG_MODULE = "axtorch.conf"
PRIMARY_CONFIG = "train"
_CHOICE_PREFIXES = ("++", "+", "~")
#: Group options under their old names, composed as the new ones (an alias file in ``conf/``) with a
#: warning, until the next release.
RENAMED_OPTIONS = {"mesh_rules=golden": "mesh_rules=by_hardware"}


def search_path_override(config_dirs: Sequence[str | Path]) -> list[str]:
    """The ``hydra.searchpath`` override that adds users' own config directories after axtorch's."""
    if not config_dirs:
        return []
    paths = []
    for directory in config_dirs:
        path = Path(directory).expanduser().resolve()
        if not path.is_dir():
            raise ConfigError(
                "--config-dir",
                str(directory),
                "an existing directory of Hydra config groups",
                reason=f"{path} is not a directory",
            )
        paths.append(f"file://{path}")
    return [f"hydra.searchpath=[{','.join(paths)}]"]


def _key(override: str) -> str:
    key = override.split("=", 1)[0]
    for prefix in _CHOICE_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _compose(overrides: Sequence[str]) -> DictConfig:
    return _compose_with_choices(overrides)[0]


def _compose_with_choices(overrides: Sequence[str]) -> tuple[DictConfig, dict[str, str]]:
    """The composed config and the option each config group took (Hydra's ``runtime.choices``)."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(CONFIG_MODULE, version_base=None):
        composed = compose(PRIMARY_CONFIG, overrides=list(overrides), return_hydra_config=True)
    choices = {str(group): str(option) for group, option in composed.hydra.runtime.choices.items()}
    with open_dict(composed):
        del composed["hydra"]
    return composed, choices


def model_from_file(composed: DictConfig, overrides: Sequence[str], choices: Mapping[str, str]) -> DictConfig:
    """``composed`` with ``init_from``'s model when no preset was chosen for it (``model_from_init``)."""
    default = default_model_choice(CONFIG_MODULE, PRIMARY_CONFIG)
    if takes_model_from_file(composed, overrides, choices.get("model", default), default):
        return with_model_from_file(composed, overrides)
    return composed


@functools.cache
def _package_config_groups() -> frozenset[str]:
    """axtorch's own config groups (``model``, ``model/ffn``, ...): fixed for the process's lifetime."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(CONFIG_MODULE, version_base=None):
        loader = GlobalHydra.instance().config_loader()
        groups: set[str] = set()
        pending = [""]
        while pending:
            parent = pending.pop()
            for name in loader.list_groups(parent):
                groups.add(f"{parent}/{name}" if parent else name)
                pending.append(f"{parent}/{name}" if parent else name)
    return frozenset(groups)


def _config_groups(overrides: Sequence[str]) -> set[str]:
    """Every config group: axtorch's and those of users' own directories."""
    groups = set(_package_config_groups())
    for directory in _user_config_dirs(overrides):
        groups |= {str(d.relative_to(directory)) for d in directory.rglob("*") if d.is_dir() and any(d.glob("*.yaml"))}
    return groups


def _user_config_dirs(overrides: Sequence[str]) -> list[Path]:
    """The ``file://`` entries of a ``hydra.searchpath`` override."""
    dirs: list[Path] = []
    for override in overrides:
        if _key(override) == "hydra.searchpath":
            parsed = OverridesParser.create().parse_overrides([override])[0].value()
            entries = parsed if isinstance(parsed, list) else []  # hydra.searchpath is a list
            dirs += [Path(entry[len("file://") :]) for entry in entries if str(entry).startswith("file://")]
    return dirs


def check_overrides(overrides: Sequence[str]) -> None:
    """Fail on an override whose key does not exist, naming it and the closest valid keys.

    Strict with or without Hydra's ``+``/``++``/``~`` prefixes: an experiment's keys are exactly
    its dataclass fields, so ``+trainer.no_such_key=3`` is a typo, not a new setting. Group
    choices (``model=...``, ``model/ffn=...``) are applied first so that keys introduced by a
    chosen child (``data.source.paths`` for ``data=text_files``) are known; Hydra itself rejects
    an unknown option of a group.
    """
    groups = _config_groups(overrides)
    is_setting = [not (_key(o) in groups or "/" in _key(o) or _key(o).startswith("hydra.")) for o in overrides]
    settings = [o for o, setting in zip(overrides, is_setting) if setting]
    if settings:
        base = _compose([o for o, setting in zip(overrides, is_setting) if not setting])
        check_keys_exist(base, [f"{_key(o)}={o.partition('=')[2]}" for o in settings])


def check_keys_exist(base: DictConfig, overrides: Sequence[str]) -> None:
    """Raise ``ConfigError`` for the first ``key=value`` whose dotted key is not in ``base``."""
    for override in overrides:
        key, _, value = override.partition("=")
        node: Optional[Node] = base
        walked: list[str] = []
        for part in key.split("."):
            # keys(), not `in`: a DictConfig says a key whose value is still ??? is not in it.
            if not isinstance(node, DictConfig) or part not in node.keys():  # noqa: SIM118
                parent = ".".join(walked) or "<root>"
                allowed = sorted(str(k) for k in node) if isinstance(node, DictConfig) else []
                close = difflib.get_close_matches(part, allowed, n=1)
                hint = f" (did you mean {'.'.join(walked + close)}?)" if close else ""
                raise ConfigError(
                    key, value, f"keys of {parent}: {allowed}", reason=f"{parent} has no key {part!r}{hint}"
                )
            walked.append(part)
            node = node._get_node(part)
            if isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict:
                break  # a mapping of the user's own names (decoder variants): its owner validates them


def to_experiment_config(cfg: DictConfig) -> ExperimentConfig:
    """Convert a composed config into typed dataclasses and run the cross-field checks."""
    resolve_mixture_sources(cfg)
    try:
        config = to_object(cfg, ExperimentConfig)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "<config>"
        raise ConfigError(key, "???", "every required value set", reason=str(error).splitlines()[0]) from error
    config.validate()
    return config


def compose_experiment_config(
    overrides: Sequence[str] = (), config_dirs: Sequence[str | Path] = (), apply_mesh_rules: bool = True
) -> DictConfig:
    """The composed (unvalidated) DictConfig for ``overrides``, as ``axtorch-train`` would see it.

    ``config_dirs`` are users' own config directories (``axtorch-train --config-dir``), searched
    after axtorch's: their experiments and presets are chosen like the built-in ones. With
    ``apply_mesh_rules``, the matching mesh rule's overrides and then ``sharding=auto``'s choice are
    applied (``resolve_choices``).
    """
    composed = _compose_checked([*overrides, *search_path_override(config_dirs)])
    if not apply_mesh_rules:
        return composed
    return resolve_choices(overrides, composed, config_dirs)[1]


def resolve_choices(
    overrides: Sequence[str], composed: DictConfig, config_dirs: Sequence[str | Path] = ()
) -> tuple[list[str], DictConfig]:
    """The overrides and config after the choices composition makes for the user: the mesh rule's
    overrides (``with_mesh_rule``), then the preset ``sharding=auto`` picks (``with_auto_sharding``).

    ``composed`` is the config of ``overrides``; each choice that changes the overrides composes again.
    """
    current = list(overrides)
    for choose in (with_mesh_rule, with_auto_sharding):
        chosen = choose(current, composed)
        if chosen != current:
            current, composed = chosen, _compose_checked([*chosen, *search_path_override(config_dirs)])
    return current, composed


def with_auto_sharding(overrides: Sequence[str], composed: DictConfig) -> list[str]:
    """``overrides`` with ``sharding=<preset>`` for the mesh, when the sharding is ``auto`` (the default).

    ``auto`` composes as ``replicated`` (plus ``sharding.auto=true``), so a mesh that needs no other
    preset composes once; any other choice replaces the ``auto`` and keeps the record.
    """
    if not composed.sharding.auto or any(_key(o) == "sharding" and o.partition("=")[2] != "auto" for o in overrides):
        return list(overrides)
    preset = auto_sharding_preset({axis: int(size) for axis, size in composed.mesh.items() if axis != "dcn"})
    if preset == "replicated":
        return list(overrides)
    return [*(o for o in overrides if _key(o) != "sharding"), f"sharding={preset}", "sharding.auto=true"]


def describe_auto_sharding(composed: DictConfig) -> str:
    """What ``sharding=auto`` chose and why, for the start-up line: ``fsdp_tp (mesh fsdp=4 model=2)``."""
    split = {axis: size for axis, size in composed.mesh.items() if axis != "dcn" and size != 1}
    preset = auto_sharding_preset(split)
    return f"{preset} (mesh {' '.join(f'{a}={s}' for a, s in split.items()) or 'of one device'})"


def with_mesh_rule(overrides: Sequence[str], composed: DictConfig) -> list[str]:
    """``overrides`` with those of the mesh rule that matches the hardware before them (``mesh_rules``).

    ``composed`` is the config of ``overrides`` alone. The command line's own overrides win over the
    rule's; the hardware id and the rule's pattern are recorded in ``mesh_rules``. Unchanged
    without rules.
    """
    rules = composed.mesh_rules.rules
    if not rules:
        return list(overrides)
    hardware = composed.mesh_rules.hardware or detect_hardware_id()
    rule = select_rule(list(rules), hardware)
    explicit = {_key(override) for override in overrides}
    chosen = [override for override in rule.overrides if _key(override) not in explicit]
    record = [f"mesh_rules.selected={_quoted(rule.hardware)}"]
    if "mesh_rules.hardware" not in explicit:
        record.append(f"mesh_rules.hardware={_quoted(hardware)}")
    return [*chosen, *overrides, *record]


def _quoted(value: str) -> str:
    """``value`` as a Hydra override value that its grammar reads back verbatim (a regex has [] and ())."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _compose_checked(overrides: Sequence[str]) -> DictConfig:
    """``_compose``, with Hydra's and OmegaConf's errors turned into ConfigErrors that name the key."""
    for override in overrides:
        if override in RENAMED_OPTIONS:
            warnings.warn(
                f"{override} is deprecated and will be removed in the next release: use {RENAMED_OPTIONS[override]}",
                FutureWarning,
                stacklevel=2,
            )
    try:
        try:
            composed, choices = _compose_with_choices(overrides)
        except (HydraException, OmegaConfBaseException):
            check_overrides(overrides)  # an unknown key gets its own message, with the closest valid keys
            raise
        # Hydra refuses an unknown key by itself, unless a + or ++ adds it: check those strictly.
        if any(override.startswith(("+", "~")) for override in overrides):
            check_overrides(overrides)
        return model_from_file(composed, overrides, choices)
    except OverrideParseException as error:
        key, _, value = error.override.partition("=")
        raise ConfigError(
            key,
            value,
            "Hydra's override grammar: quote values with special characters, e.g. "
            "'data.source.paths=[\"~/corpus/**/*.txt\"]'",
            reason=f"cannot parse {error.override!r}",
        ) from error
    except MissingConfigException as error:
        group, _, option = (error.missing_cfg_file or "?/?").rpartition("/")
        raise ConfigError(group, option, f"one of {sorted(error.options or [])}", reason=_first_line(error)) from error
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(
            _failing_key(error),
            _failing_value(error, overrides),
            _allowed(error),
            reason=_first_line(_root_cause(error)),
        ) from error


def load_experiment_config(overrides: Sequence[str] = (), config_dirs: Sequence[str | Path] = ()) -> ExperimentConfig:
    """Compose, type-check and validate the experiment config for ``overrides``."""
    return to_experiment_config(compose_experiment_config(overrides, config_dirs))


def _root_cause(error: BaseException) -> BaseException:
    """The OmegaConf error behind a Hydra one that names the failing key (``full_key``), else the innermost.

    Hydra re-raises composition errors without chaining them as the cause, so the context is
    followed too; and OmegaConf chains its own cause (a bare ValueError, with no key) only while a
    tracer runs (a debugger, coverage) or ``OC_CAUSE=1``, so the walk stops at the first error
    that names a key rather than at the end of the chain.
    """
    seen: set[int] = set()
    while id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OmegaConfBaseException) and getattr(error, "full_key", None):
            return error
        following = error.__cause__ or error.__context__
        if following is None:
            break
        error = following
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
