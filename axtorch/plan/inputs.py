"""The planner's inputs: the experiment config composed as ``axtorch-train`` composes it, and its mesh."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from axtorch.compose.experiment_loader import compose_experiment_config, to_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.config.serialize import to_object
from axtorch.parallel.backend_kind import BackendKind
from axtorch.parallel.hardware import device_count
from axtorch.parallel.mesh import MESH_AXES, MeshConfig
from axtorch.train.experiment import ExperimentConfig


def load_plan_inputs(
    overrides: Sequence[str], devices: Optional[int] = None, config_dirs: Sequence[str | Path] = ()
) -> tuple[ExperimentConfig, dict[str, int]]:
    """Compose and validate the config as ``axtorch-train`` would, and resolve its mesh.

    The train-time checks assume the single backend's one-device mesh, so the mesh is set aside
    while they run and resolved here against ``devices`` (default: the mesh rule's hardware id's,
    else the product of the axes). ``config_dirs`` are users' own config directories.
    """
    cfg = compose_experiment_config(overrides, config_dirs)
    mesh = to_object(cfg.mesh, MeshConfig)
    cfg.mesh = MeshConfig()
    config = to_experiment_config(cfg)
    config.mesh = mesh
    if devices is None and config.mesh_rules.hardware is not None:
        devices = device_count(config.mesh_rules.hardware)  # a mesh rule's target: its devices
    if devices is None:
        inferred = [axis for axis in MESH_AXES if getattr(mesh, axis) == -1]
        if inferred:
            raise ConfigError("devices", None, "the device count", reason=f"mesh.{inferred[0]}=-1 is inferred from it")
        devices = math.prod(getattr(mesh, axis) for axis in MESH_AXES)
    sizes = mesh.resolve(devices, "mesh")
    # What the train-time checks skipped with the mesh set aside (the batch's are the plan's own);
    # a plan of several devices is the native backend's unless it names another.
    resolved = mesh.with_sizes(sizes)
    several = devices > 1 and config.backend is BackendKind.single
    planned = dataclasses.replace(config, mesh=resolved, backend=BackendKind.native if several else config.backend)
    planned.validate_layers_against_mesh()
    if sizes["pipe"] > 1:
        planned.validate_pipeline_limits()
    return config, sizes
