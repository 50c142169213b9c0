"""The named device mesh: how many devices each parallelism axis spans."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from axtorch.config.errors import ConfigError

#: Axis order of the mesh, outermost (slowest interconnect) first.
MESH_AXES = ("pipe", "data", "fsdp", "seq", "expert", "model")


@dataclass
class DcnMeshConfig:
    """For multi-slice TPU: how many slices each axis spans over the data-center network (DCN)."""

    pipe: int = 1
    data: int = 1
    fsdp: int = 1
    seq: int = 1
    expert: int = 1
    model: int = 1


@dataclass
class MeshConfig:
    """Sizes of the named mesh axes; at most one may be -1, meaning "whatever the devices leave".

    Sizes are totals. On multi-slice TPU, ``dcn`` says how many slices of each axis lie across
    the slower network (usually only ``data``); the rest of each axis lies within a slice.
    """

    #: Pipeline stages (native backend): each process of a ``pipe`` group holds different layers.
    pipe: int = 1
    data: int = 1
    fsdp: int = 1
    seq: int = 1
    expert: int = 1
    model: int = 1
    dcn: DcnMeshConfig = field(default_factory=DcnMeshConfig)

    def resolve_dcn(self, sizes: dict[str, int], key: str = "mesh.dcn") -> dict[str, int]:
        """DCN sizes per axis, each dividing that axis's total size."""
        dcn = {axis: getattr(self.dcn, axis) for axis in MESH_AXES}
        for axis, slices in dcn.items():
            if slices < 1 or sizes[axis] % slices:
                raise ConfigError(f"{key}.{axis}", slices, f"a positive divisor of mesh.{axis}={sizes[axis]}")
        return dcn

    def with_sizes(self, sizes: dict[str, int]) -> MeshConfig:
        """A copy with every axis set to its resolved size (``resolve``'s: no -1 left)."""
        axes: dict[str, Any] = {axis: sizes[axis] for axis in MESH_AXES}
        return replace(self, **axes)

    def resolve(self, num_devices: int, key: str = "mesh") -> dict[str, int]:
        """Axis sizes whose product is ``num_devices``, or a ConfigError naming the mismatch."""
        sizes = {axis: getattr(self, axis) for axis in MESH_AXES}
        inferred = [axis for axis, size in sizes.items() if size == -1]
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                raise ConfigError(f"{key}.{axis}", size, "a positive integer, or -1 to infer it")
        if len(inferred) > 1:
            raise ConfigError(f"{key}.{inferred[1]}", -1, "at most one axis set to -1", reason=f"{inferred} are all -1")
        known = 1
        for size in sizes.values():
            known *= size if size > 0 else 1
        if inferred:
            if num_devices % known:
                raise ConfigError(
                    f"{key}.{inferred[0]}",
                    -1,
                    f"an axis product dividing {num_devices} devices",
                    reason=f"the other axes multiply to {known}",
                )
            sizes[inferred[0]] = num_devices // known
        elif known != num_devices:
            described = " x ".join(f"{axis}={size}" for axis, size in sizes.items() if size != 1) or "all axes 1"
            raise ConfigError(
                key,
                described,
                f"axis sizes whose product is the device count {num_devices}",
                reason=f"mesh axes {described} need {known} devices, found {num_devices}",
            )
        return sizes
