"""The mesh search: every mesh and remat policy axtorch can run for a model on a cluster, ranked.

The planner enumerates meshes over the six axes (``pipe``, ``data``, ``fsdp``, ``seq``,
``expert``, ``model``) and the remat policies, keeps those whose per-device memory
(``memory.device_memory``, the model ``axtorch-plan`` reports) fits with headroom, and ranks them
by estimated MFU: the model FLOPs over the analytical step time (``step_time``) at the device's
peak for ``trainer.precision``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

import torch

from axtorch.compose.registry import CHOICES
from axtorch.config.errors import ConfigError
from axtorch.layers.remat import RematConfig
from axtorch.parallel.pipeline_config import PipelineConfig
from axtorch.parallel.sharding import PartitionSpec, ShardingConfig, resolve_parameter_specs
from axtorch.plan.cluster import Cluster
from axtorch.plan.memory import device_memory, native_fsdp_specs, parameter_elements, stage_layers
from axtorch.plan.step_time import RECOMPUTE, StepTimeModel
from axtorch.train.experiment import ExperimentConfig
from axtorch.train.flops import layer_flops_per_token, model_flops_per_token

#: The ``model/remat`` choices, as the command line names them.
REMAT_CONFIGS: dict[str, Optional[RematConfig]] = {
    name: choice["remat"] for name, choice in CHOICES["model/remat"][1].items()
}


@dataclass(frozen=True)
class Candidate:
    mesh: dict[str, int]
    backend: str
    sharding: str
    remat: str
    microbatches: int
    memory_bytes: float
    step_seconds: float
    mfu: float
    #: Seconds of the step by cause: compute, bubble, and each collective's exposed share.
    parts: dict[str, float] = field(default_factory=dict)

    def overrides(self) -> list[str]:
        """What to pass ``axtorch-train`` (or a ``mesh_rules`` entry) to run this candidate."""
        mesh = [f"mesh.{axis}={size}" for axis, size in self.mesh.items() if size > 1]
        pipe = [f"pipeline.microbatches={self.microbatches}"] if self.mesh["pipe"] > 1 else []
        return [f"backend={self.backend}", *mesh, f"sharding={self.sharding}", f"model/remat={self.remat}", *pipe]

    def why(self) -> str:
        total = self.step_seconds
        shares = sorted(self.parts.items(), key=lambda item: -item[1])
        return ", ".join(f"{name} {seconds / total:.0%}" for name, seconds in shares if seconds / total >= 0.005)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(devices: int, config: ExperimentConfig, seq_len: int, stages: bool) -> list[dict[str, int]]:
    """Meshes axtorch can run for this model on ``devices`` (its pipeline and axis limits applied;
    pipeline stages only where ``stages``)."""
    model = config.model
    layers = model.decoder.keyed_layer_configs().values()  # every variant of a stack must fit the mesh
    kv_heads = [layer.attention.resolved_kv_heads() for layer in layers]
    num_experts = [getattr(layer.feed_forward, "num_experts", 1) for layer in layers]
    mixes_tokens = any(layer.feed_forward.mixes_tokens for layer in layers)
    meshes = []
    for model_axis in _divisors(devices):
        if model_axis > 16 or any(heads % model_axis for heads in kv_heads):
            continue
        for expert in _divisors(devices // model_axis):
            if any(experts % expert for experts in num_experts) or (expert > 1 and model_axis > 1):
                continue
            for seq in (1, 2, 4, 8):
                rest = devices // (model_axis * expert)
                if rest % seq or seq_len % (2 * seq):
                    continue
                for pipe in _divisors(rest // seq):
                    if pipe > 1 and (not stages or seq > 1 or mixes_tokens or model.tie_embeddings):
                        continue
                    if pipe > model.decoder.num_layers:
                        continue
                    shards = rest // (seq * pipe)
                    for data in _divisors(shards):
                        meshes.append(
                            {"pipe": pipe, "data": data, "fsdp": shards // data, "seq": seq, "expert": expert}
                            | {"model": model_axis}
                        )
    return meshes


class Planner:
    """Scores meshes for one model, cluster, sequence length and global batch."""

    def __init__(
        self,
        config: ExperimentConfig,
        shardings: Mapping[str, ShardingConfig],
        cluster: Cluster,
        seq_len: int,
        global_batch: int,
        kernel_efficiency: float = 0.7,
        headroom: float = 0.9,
    ):
        if seq_len > config.model.max_seq_len:
            raise ConfigError("seq_len", seq_len, f"at most model.max_seq_len={config.model.max_seq_len}")
        self.config = config
        self.shardings = shardings
        self.cluster = cluster
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.headroom = headroom
        with torch.device("meta"):
            network = config.model.build()
        self.shapes = {name: tuple(p.shape) for name, p in network.named_parameters()}
        flops_per_token = model_flops_per_token(config.model, seq_len, network)
        #: What pipeline stages balance, as a run's do.
        self.layer_costs = layer_flops_per_token(config.model, seq_len)
        self.step_time = StepTimeModel(
            config, self.shapes, cluster, seq_len, global_batch, flops_per_token, self.layer_costs, kernel_efficiency
        )
        self._specs: dict[tuple[str, tuple[int, ...]], dict[str, PartitionSpec]] = {}
        self._elements: dict[tuple[str, tuple[int, ...]], int] = {}

    def search(self) -> list[Candidate]:
        """Every candidate that fits, best estimated MFU first."""
        found = []
        stages = self.cluster.backend == "native"
        for mesh in _meshes(self.cluster.devices, self.config, self.seq_len, stages):
            sharding = "fsdp_tp" if mesh["model"] > 1 else "fsdp_ep" if mesh["expert"] > 1 else "fsdp"
            for remat in RECOMPUTE:
                if remat == "selective" and self.cluster.backend == "xla":  # refused there (ExperimentConfig)
                    continue
                candidate = self.score(mesh, sharding, remat)
                if candidate is not None and candidate.memory_bytes <= self.headroom * self.cluster.memory_bytes:
                    found.append(candidate)
        return sorted(found, key=lambda c: (-round(c.mfu, 4), c.memory_bytes))

    def score(self, mesh: dict[str, int], sharding: str, remat: str) -> Optional[Candidate]:
        """Memory and step time of one mesh, or None where the batch does not split over it."""
        replicas = mesh["data"] * mesh["fsdp"] * mesh["expert"]
        if self.global_batch % replicas:
            return None
        rows = self.global_batch // replicas
        pipe = mesh["pipe"]
        pipeline = PipelineConfig()
        microbatches = pipeline.resolved_microbatches(pipe, rows) if pipe > 1 else 1
        if pipe > 1 and (rows % microbatches or microbatches < pipe):
            return None
        try:
            specs = self.specs(sharding, mesh)
        except ConfigError:
            return None  # the preset does not split this model's dimensions on this mesh
        model = copy.deepcopy(self.config.model)
        model.decoder.remat = REMAT_CONFIGS[remat]
        elements = self._parameter_elements(sharding, mesh, pipeline)
        precision = self.config.trainer.precision
        memory = device_memory(
            model,
            elements,
            mesh,
            precision,
            rows // microbatches,
            self.seq_len,
            pipeline,
            self.layer_costs,
            microbatches,
            keeps_weights_gathered=self.cluster.device.chip.topology_generation is not None,  # measured on TPUs
        )
        bubble = pipeline.bubble(pipe, microbatches) if pipe > 1 else 0.0
        first_stage = len(stage_layers(self.layer_costs, pipe, pipeline)[0])
        parts = self.step_time.parts(mesh, specs, remat, rows, bubble, first_stage)
        step = sum(parts.values())
        mfu = self.step_time.model_flops_seconds() / step
        return Candidate(
            dict(mesh), self.cluster.backend, sharding, remat, microbatches, memory.total_bytes, step, mfu, parts
        )

    def collective_bytes(self, mesh: dict[str, int], sharding: str, rows: int, stage_layers: int) -> dict[str, float]:
        """``StepTimeModel.collective_bytes`` for ``sharding``'s specs on ``mesh``."""
        return self.step_time.collective_bytes(mesh, self.specs(sharding, mesh), rows, stage_layers)

    def _parameter_elements(self, sharding: str, mesh: dict[str, int], pipeline: PipelineConfig) -> int:
        """``memory.parameter_elements`` of a mesh, computed once for all its remat policies."""
        key = (sharding, tuple(mesh.values()))
        if key not in self._elements:
            self._elements[key] = parameter_elements(
                self.shapes, self.specs(sharding, mesh), mesh, self.layer_costs, pipeline
            )
        return self._elements[key]

    def specs(self, sharding: str, mesh: dict[str, int]) -> dict[str, PartitionSpec]:
        """Each parameter's spec under the preset ``sharding`` on ``mesh`` (resolved once per pair)."""
        key = (sharding, tuple(mesh.values()))
        if key not in self._specs:
            specs = resolve_parameter_specs(self.shapes, self.shardings[sharding], mesh)
            native = self.cluster.backend == "native"
            self._specs[key] = native_fsdp_specs(self.shapes, specs, mesh) if native else specs
        return self._specs[key]
