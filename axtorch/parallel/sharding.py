"""Sharding rules: regexes over parameter and module names mapped to partition specs.

Layers never know how they are sharded. A ``ShardingConfig`` (a preset in ``conf/sharding/``)
names, for every parameter, which mesh axes split each tensor dimension, and for chosen module
boundaries, how an input/output field is split; a backend reads the resolved specs and applies
them from outside. Resolution checks everything a backend would trip over later (unknown axes,
wrong rank, indivisible dimensions, rules that match nothing) before any device is touched.

A spec has one entry per tensor dimension: ``None`` (replicated), one mesh axis (``"fsdp"``) or
several axes split in order (``"data,fsdp"``). Resolved, each entry is ``None`` or a tuple of axis
names, the form DTensor/GSPMD partition specs take.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from axtorch.config.errors import ConfigError

#: Per tensor dimension, the mesh axes splitting it (in order), or None for replicated.
PartitionSpec = tuple[Optional[tuple[str, ...]], ...]
#: The axes the native backend's FSDP shards a parameter over (one flattened mesh): every axis but
#: ``data`` (replicated) that is data-parallel outside the experts. The planner counts by it too.
NATIVE_FSDP_AXES = ("fsdp", "seq", "expert")

ACTIVATION_IO = ("input", "output")


@dataclass
class ParameterRule:
    #: Regex full-matched against the parameter's fully qualified name.
    pattern: str = ""
    #: One entry per tensor dimension: a mesh axis, axes joined by commas, or null (replicated).
    spec: list[Optional[str]] = dataclasses.field(default_factory=list)
    #: Allow the rule to match nothing, for parameters only some models have (biases). It also
    #: hides a misspelt pattern, so presets set it only on such rules.
    optional: bool = False


@dataclass
class ActivationRule:
    #: Regex full-matched against the module's fully qualified name, e.g. ``decoder\.layers\.\d+``.
    module: str = ""
    #: A field of that module's input or output dataclass, e.g. ``hidden_states``.
    field: str = ""
    #: ``input`` or ``output``.
    io: str = "output"
    spec: list[Optional[str]] = dataclasses.field(default_factory=list)


@dataclass
class ShardingConfig:
    """Rules for every parameter and for chosen activations; the first matching rule wins."""

    parameters: list[ParameterRule] = dataclasses.field(default_factory=list)
    activations: list[ActivationRule] = dataclasses.field(default_factory=list)
    #: A parameter that no rule covers is an error (otherwise it is replicated).
    require_full_coverage: bool = True
    #: True when ``sharding=auto`` chose these rules from the mesh (``auto_sharding_preset``); a
    #: record in config.yaml, set at composition.
    auto: bool = False


def auto_sharding_preset(mesh_sizes: Mapping[str, int]) -> str:
    """The ``conf/sharding/`` preset that ``sharding=auto`` picks for a mesh (sizes as configured, -1 allowed).

    A split axis asks for the preset that uses it: ``expert`` -> ``fsdp_ep``, ``model`` ->
    ``fsdp_tp``, ``fsdp`` -> ``fsdp``; a mesh that splits only the batch, sequences or stages
    (``data``, ``seq``, ``pipe``) keeps every parameter whole (``replicated``). An axis of -1
    counts as split: it takes whatever devices the others leave.
    """
    split = {axis for axis, size in mesh_sizes.items() if size != 1}
    if {"expert", "model"} <= split:
        raise ConfigError(
            "sharding",
            "auto",
            "an explicit preset of your own (see docs/parallelism.md, 'Sharding rules')",
            reason="no built-in preset splits both mesh.expert and mesh.model",
        )
    for axis, preset in (("expert", "fsdp_ep"), ("model", "fsdp_tp"), ("fsdp", "fsdp")):
        if axis in split:
            return preset
    return "replicated"


def resolve_parameter_specs(
    named_shapes: Mapping[str, tuple[int, ...]],
    config: ShardingConfig,
    mesh_sizes: Mapping[str, int],
    key: str = "sharding",
) -> dict[str, PartitionSpec]:
    """The partition spec of every parameter in ``named_shapes``, checked against its shape and the mesh.

    Raises ``ConfigError`` (keyed ``<key>.parameters[i]...``) for a rule that applies to no
    parameter, an uncovered parameter under ``require_full_coverage``, and any spec that is the
    wrong length, names an unknown or repeated axis, or splits a dimension unevenly.
    """
    rules = list(enumerate(config.parameters))
    patterns = [_compile(rule.pattern, f"{key}.parameters[{i}].pattern") for i, rule in rules]
    rule_specs = [_parse_spec(rule.spec, mesh_sizes, f"{key}.parameters[{i}].spec") for i, rule in rules]
    specs: dict[str, PartitionSpec] = {}
    applied: set[int] = set()
    matched: set[int] = set()
    for name, shape in named_shapes.items():
        hits = [i for i, pattern in enumerate(patterns) if pattern.fullmatch(name)]
        matched.update(hits)
        if not hits:
            if config.require_full_coverage:
                raise ConfigError(
                    f"{key}.parameters",
                    name,
                    "a rule whose pattern full-matches every parameter name",
                    reason=f"no rule covers parameter {name} of shape {tuple(shape)} "
                    f"(set {key}.require_full_coverage=false to replicate uncovered parameters)",
                )
            specs[name] = (None,) * len(shape)
            continue
        index = hits[0]
        _check_fits(
            name,
            tuple(shape),
            rule_specs[index],
            mesh_sizes,
            f"{key}.parameters[{index}].spec",
            list(config.parameters[index].spec),
            chosen_by_auto=config.auto,
        )
        specs[name] = rule_specs[index]
        applied.add(index)
    for i, rule in rules:
        if i not in applied and not rule.optional:
            reason = (
                "every parameter it matches is claimed by an earlier rule (the first match wins)"
                if i in matched
                else "its pattern matches no parameter"
            )
            raise ConfigError(
                f"{key}.parameters[{i}].pattern",
                rule.pattern,
                "a pattern that full-matches some parameter name",
                reason=f"{reason}; parameters look like {_examples(named_shapes)}",
            )
    return specs


def resolve_activation_specs(
    module_names: Iterable[str],
    config: ShardingConfig,
    mesh_sizes: Mapping[str, int],
    key: str = "sharding",
) -> dict[tuple[str, str, str], PartitionSpec]:
    """``(module name, io, field) -> spec`` for every module an activation rule matches.

    The first rule for a given (module, io, field) wins. Shapes are only known at run time, so
    divisibility is the backend's check; everything else is checked here, as for parameters.
    """
    names = list(module_names)
    specs: dict[tuple[str, str, str], PartitionSpec] = {}
    for i, rule in enumerate(config.activations):
        rule_key = f"{key}.activations[{i}]"
        if rule.io not in ACTIVATION_IO:
            raise ConfigError(f"{rule_key}.io", rule.io, f"one of {list(ACTIVATION_IO)}")
        pattern = _compile(rule.module, f"{rule_key}.module")
        spec = _parse_spec(rule.spec, mesh_sizes, f"{rule_key}.spec")
        modules = [name for name in names if pattern.fullmatch(name)]
        if not modules:
            raise ConfigError(
                f"{rule_key}.module",
                rule.module,
                "a pattern that full-matches some module name",
                reason=f"its pattern matches no module; modules look like {_examples(names)}",
            )
        for module in modules:
            specs.setdefault((module, rule.io, rule.field), spec)
    return specs


def shard_shape(shape: Sequence[int], spec: PartitionSpec, mesh_sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The per-device shape of a tensor of ``shape`` split by ``spec`` (every split must be even)."""
    if len(shape) != len(spec):
        raise ValueError(f"spec {spec} has {len(spec)} entries for a tensor of rank {len(shape)}")
    shards = []
    for size, axes in zip(shape, spec):
        ways = _ways(axes, mesh_sizes)
        if size % ways:
            raise ValueError(f"dimension of size {size} does not split evenly {ways} ways over {axes}")
        shards.append(size // ways)
    return tuple(shards)


def _ways(axes: Optional[tuple[str, ...]], mesh_sizes: Mapping[str, int]) -> int:
    return math.prod(mesh_sizes[axis] for axis in axes or ())


def _compile(pattern: str, key: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ConfigError(key, pattern, "a Python regular expression", reason=str(error)) from error


def _parse_spec(entries: Sequence[Optional[str]], mesh_sizes: Mapping[str, int], key: str) -> PartitionSpec:
    spec: list[Optional[tuple[str, ...]]] = []
    seen: set[str] = set()
    for entry in entries:
        if entry is None:
            spec.append(None)
            continue
        axes = tuple(axis.strip() for axis in entry.split(","))
        for axis in axes:
            if axis not in mesh_sizes:
                raise ConfigError(
                    key,
                    list(entries),
                    f"mesh axes {list(mesh_sizes)}, comma-joined to split one dimension over several, or null",
                    reason=f"unknown mesh axis {axis!r}",
                )
            if axis in seen:
                raise ConfigError(
                    key,
                    list(entries),
                    "each mesh axis at most once per spec",
                    reason=f"mesh axis {axis!r} splits more than one dimension",
                )
            seen.add(axis)
        spec.append(axes)
    return tuple(spec)


def _check_fits(
    name: str,
    shape: tuple[int, ...],
    spec: PartitionSpec,
    mesh_sizes: Mapping[str, int],
    key: str,
    entries: list,
    chosen_by_auto: bool = False,
) -> None:
    if len(spec) != len(shape):
        raise ConfigError(
            key,
            entries,
            f"{len(shape)} entries, one per dimension",
            reason=f"parameter {name} has shape {shape} (rank {len(shape)}) but the spec has {len(spec)} entries",
        )
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        if axes is None:  # replicated: fits any size
            continue
        ways = _ways(axes, mesh_sizes)
        if size % ways:
            product = " x ".join(f"{axis}={mesh_sizes[axis]}" for axis in axes)
            if len(axes) > 1:
                product += f" = {ways}"
            raise ConfigError(
                key,
                entries,
                f"axes whose sizes multiply to a divisor of {size}",
                reason=f"parameter {name} dim {dim} has size {size}, not divisible by {product}"
                + (
                    f" (sharding=auto chose this preset for the mesh: name another, e.g. sharding=replicated,"
                    f" or choose mesh sizes that divide {size})"
                    if chosen_by_auto
                    else ""
                ),
            )


def _examples(names: Iterable[str], count: int = 3) -> list[str]:
    return list(names)[:count]
