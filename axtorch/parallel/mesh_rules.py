"""Mesh rules (AXLearn's ``mesh_rules``): hardware ids matched in order to config overrides.

One experiment config carries a rule per kind of cluster it may run on; at composition the first
rule whose pattern matches the hardware id (``hardware.detect_hardware_id``, or
``mesh_rules.hardware`` to simulate another) contributes its overrides: backend, mesh, sharding,
remat, precision, batch split. Overrides given on the command line win over the rule's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from axtorch.config.errors import ConfigError


@dataclass
class MeshRule:
    #: A regular expression that must match the whole hardware id, e.g. ``gpu-H100-8x.*``.
    hardware: str = ""
    #: Hydra overrides, as on the command line: ``backend=native``, ``mesh.fsdp=-1``, ``sharding=fsdp``.
    overrides: list[str] = field(default_factory=list)


@dataclass
class MeshRulesConfig:
    #: The rules, tried in order; empty applies none.
    rules: list[MeshRule] = field(default_factory=list)
    #: The hardware id to choose for; null detects this machine's (set it to plan for another).
    hardware: Optional[str] = None
    #: The pattern of the rule that was applied: written at composition, recorded in config.yaml.
    selected: Optional[str] = None


def select_rule(rules: list[MeshRule], hardware: str) -> MeshRule:
    """The first rule whose pattern matches ``hardware`` in full; a ConfigError listing them all if none does."""
    for index, rule in enumerate(rules):
        try:
            if re.fullmatch(rule.hardware, hardware):
                return rule
        except re.error as error:
            raise ConfigError(
                f"mesh_rules.rules[{index}].hardware", rule.hardware, "a regular expression", reason=str(error)
            ) from error
    raise ConfigError(
        "mesh_rules.hardware",
        hardware,
        f"an id that one of the rules matches: {[rule.hardware for rule in rules]}",
        reason="no mesh rule matches this hardware; add one, or choose mesh_rules=none",
    )
