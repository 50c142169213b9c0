"""``axtorch-plan hardware=ID`` (or ``devices=N device_memory=80GiB``): the mesh to train on, chosen.

The planner enumerates meshes over the six axes (``pipe``, ``data``, ``fsdp``, ``seq``,
``expert``, ``model``) and the remat policies that axtorch can run for the model, keeps those
whose per-device memory fits with headroom, and ranks them by an analytical step time:

- **compute**: the model's training FLOPs for the global batch (plus what remat recomputes:
  full remat one more forward, selective a tenth) spread over the devices at
  ``kernel_efficiency`` of the chip's datasheet bf16 peak;
- **pipeline bubble**: ``(pipe - 1) / (stages per process x micro-batches)`` of the compute;
- **exposed communication**, from the bytes each collective moves per device and the bandwidth
  of the link it crosses (the fast domain, NVLink or a TPU slice's ICI, when all its devices lie
  inside one; the network between hosts otherwise). FSDP's gathers and reduce-scatters and the
  data-parallel all-reduce (fp32, or bf16 as ``trainer.precision`` says) overlap with compute, so only what
  exceeds it counts; tensor-parallel all-reduces, context-parallel key/value gathers, expert
  all-to-alls and the pipeline stages' sends (activations in the compute dtype) sit on the
  critical path and count whole.

Estimated MFU is the model FLOPs over the step time at the datasheet peak. The cluster facts
(``CLUSTERS``) are vendors' published per-device figures, rounded; an id the table lacks is
refused by name. The model ignores kernel launch overheads, stragglers and overlap limits, so
its figures are upper-bound-ish: it is for ranking meshes, not for promising throughput.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from axtorch.cli.plan import GIB, _activation_bytes
from axtorch.compose.registry import CHOICES
from axtorch.config.errors import ConfigError
from axtorch.layers.remat import RematConfig
from axtorch.parallel.hardware import device_count
from axtorch.parallel.mesh import MESH_AXES
from axtorch.parallel.pipeline_config import PipelineConfig, layer_ranges, stage_parameter_names, stages_of_process
from axtorch.parallel.rules import PartitionSpec, ShardingConfig, resolve_parameter_specs
from axtorch.train.experiment import ExperimentConfig
from axtorch.train.flops import model_flops_per_token
from axtorch.train.peak_flops import DATASHEET_PEAKS

GB = 1e9
#: Per-device bytes: fp32 parameter, gradient and AdamW's two moments.
STATE_BYTES_PER_PARAMETER = 16
RECOMPUTE = {"none": 1.0, "selective": 1.1, "full": 4 / 3}
#: A mixture of experts' stacked expert weights, which expert parallelism places itself.
_EXPERT_WEIGHT = re.compile(r"\.feed_forward\.experts\.")
#: The ``model/remat`` choices, as the command line names them.
REMAT_CONFIGS: dict[str, Optional[RematConfig]] = {
    name: choice["remat"] for name, choice in CHOICES["model/remat"][1].items()
}


@dataclass(frozen=True)
class ClusterKind:
    """One accelerator's published facts, as the planner assumes them."""

    #: Matched against the hardware id's accelerator (``H100`` in ``gpu-H100-8x32``, ``v5p`` in ``tpu-v5p-512``).
    pattern: str
    #: A name ``DATASHEET_PEAKS`` recognises, for the bf16 peak.
    chip: str
    memory_gib: float
    #: Devices joined by the fast links: a GPU host's NVLink domain, a Trainium instance; a
    #: TPU slice is all fast (None).
    fast_domain: Optional[int]
    #: Per-device bandwidth, GB/s, one direction: within the fast domain, and between hosts.
    fast_gbs: float
    network_gbs: float

    @property
    def is_tpu(self) -> bool:
        return self.chip.startswith("TPU")


CLUSTERS: tuple[ClusterKind, ...] = (
    ClusterKind(r"H200", "NVIDIA H200", 141, 8, fast_gbs=450, network_gbs=50),
    ClusterKind(r"H100", "NVIDIA H100 SXM", 80, 8, fast_gbs=450, network_gbs=50),
    ClusterKind(r"B200", "NVIDIA B200", 180, 8, fast_gbs=900, network_gbs=50),
    ClusterKind(r"A100", "NVIDIA A100", 80, 8, fast_gbs=300, network_gbs=25),
    ClusterKind(r"MI300X", "AMD Instinct MI300X", 192, 8, fast_gbs=448, network_gbs=50),
    ClusterKind(r"v5p", "TPU v5p", 95, None, fast_gbs=600, network_gbs=25),
    ClusterKind(r"v5e|v5litepod", "TPU v5e", 16, None, fast_gbs=200, network_gbs=25),
    ClusterKind(r"v6e", "TPU v6e", 32, None, fast_gbs=448, network_gbs=25),
    ClusterKind(r"v4", "TPU v4", 32, None, fast_gbs=300, network_gbs=25),
    ClusterKind(r"trn2", "AWS Trainium2", 96, 16, fast_gbs=640, network_gbs=25),
)


@dataclass(frozen=True)
class Cluster:
    hardware: str
    devices: int
    memory_bytes: float
    peak_flops: float
    fast_domain: int
    fast_bandwidth: float
    network_bandwidth: float
    #: The backend that runs there: xla on TPUs (no pipeline stages), native elsewhere.
    backend: str


def cluster_for(hardware: str, device_memory_gib: Optional[float] = None) -> Cluster:
    """The cluster a hardware id names (``gpu-H100-8x32``, ``tpu-v5p-512``, ``trn2-16x4``)."""
    devices = device_count(hardware)
    kind = next((k for k in CLUSTERS if re.search(rf"-(?:{k.pattern})-", f"-{hardware}-")), None)
    if devices is None or kind is None:
        known = ", ".join(k.pattern for k in CLUSTERS)
        raise ConfigError("hardware", hardware, f"an id such as gpu-H100-8x32 or tpu-v5p-512, of a chip in ({known})")
    peak = next(p.bf16 for p in DATASHEET_PEAKS if p.chip == kind.chip)
    return Cluster(
        hardware=hardware,
        devices=devices,
        memory_bytes=(device_memory_gib or kind.memory_gib) * GIB,
        peak_flops=peak,
        fast_domain=kind.fast_domain or devices,
        fast_bandwidth=kind.fast_gbs * GB,
        network_bandwidth=kind.network_gbs * GB,
        backend="xla" if kind.is_tpu else "native",
    )


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
    attention = model.decoder.layer.attention
    feed_forward = model.decoder.layer.feed_forward
    num_experts = getattr(feed_forward, "num_experts", 1)
    meshes = []
    for model_axis in _divisors(devices):
        if model_axis > 16 or attention.resolved_kv_heads() % model_axis:
            continue
        for expert in _divisors(devices // model_axis):
            if num_experts % expert or (expert > 1 and model_axis > 1):
                continue
            for seq in (1, 2, 4, 8):
                rest = devices // (model_axis * expert)
                if rest % seq or seq_len % (2 * seq):
                    continue
                for pipe in _divisors(rest // seq):
                    if pipe > 1 and (not stages or seq > 1 or feed_forward.mixes_tokens or model.tie_embeddings):
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
        shardings: dict[str, ShardingConfig],
        cluster: Cluster,
        seq_len: int,
        global_batch: int,
        kernel_efficiency: float = 0.7,
        headroom: float = 0.9,
    ):
        self.config = config
        self.shardings = shardings
        self.cluster = cluster
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.kernel_efficiency = kernel_efficiency
        self.headroom = headroom
        with torch.device("meta"):
            network = config.model.build()
        self.shapes = {name: tuple(p.shape) for name, p in network.named_parameters()}
        self.flops_per_token = model_flops_per_token(config.model, seq_len, network)
        self._specs: dict[tuple[str, tuple[int, ...]], dict[str, PartitionSpec]] = {}
        # What FSDP moves per parameter: fp32, or bf16 gathers (and reductions) under trainer.precision=bf16.
        trainer = config.trainer
        self.gather_bytes = self.activation_bytes = trainer.precision.dtype.itemsize
        self.reduce_bytes = trainer.reduce_precision.dtype.itemsize if trainer.precision.dtype.itemsize == 2 else 4

    def search(self) -> list[Candidate]:
        """Every candidate that fits, best estimated MFU first."""
        found = []
        stages = self.cluster.backend == "native"
        for mesh in _meshes(self.cluster.devices, self.config, self.seq_len, stages):
            sharding = "fsdp_tp" if mesh["model"] > 1 else "fsdp_ep" if mesh["expert"] > 1 else "fsdp"
            for remat in RECOMPUTE:
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
            elements = self.device_elements(mesh, sharding)
        except ConfigError:
            return None  # the preset does not split this model's dimensions on this mesh
        model = copy.deepcopy(self.config.model)
        model.decoder.remat = REMAT_CONFIGS[remat]
        layers = model.decoder.num_layers
        first_stage = layer_ranges(layers, pipe, None)[0] if pipe > 1 else range(layers)
        micro_rows = rows // microbatches
        # The first process holds the most micro-batches in flight.
        in_flight = pipeline.microbatches_in_flight(pipe, microbatches) if pipe > 1 else 1
        activations = _activation_bytes(model, micro_rows, self.seq_len // mesh["seq"], mesh["model"])
        memory = STATE_BYTES_PER_PARAMETER * elements + activations * len(first_stage) / layers * in_flight
        bubble = pipeline.bubble(pipe, microbatches) if pipe > 1 else 0.0
        parts = self._step_parts(mesh, sharding, remat, rows, bubble, len(first_stage))
        step = sum(parts.values())
        mfu = self._model_flops_seconds() / step
        return Candidate(dict(mesh), self.cluster.backend, sharding, remat, microbatches, memory, step, mfu, parts)

    def device_elements(self, mesh: dict[str, int], sharding: str) -> float:
        """Parameter elements on the busiest device: the first pipeline stage's, split by ``sharding``'s specs."""
        return sum(self._device_parameter_elements(mesh, sharding).values())

    def _device_parameter_elements(self, mesh: dict[str, int], sharding: str) -> dict[str, float]:
        """Each of ``device_elements``'s parameters, by name: the collectives treat some apart (experts)."""
        specs = self._resolved(sharding, mesh)
        pipe = mesh["pipe"]
        layers = self.config.model.decoder.num_layers
        stage_layers = layer_ranges(layers, pipe, None) if pipe > 1 else [range(layers)]
        names = stage_parameter_names(self.shapes, stage_layers, stages_of_process(0, pipe, 1) if pipe > 1 else [0])
        return {name: math.prod(self.shapes[name]) / _ways(specs[name], mesh) for name in names}

    def _model_flops_seconds(self) -> float:
        """The step's model FLOPs at every device's datasheet peak: the time MFU compares with."""
        tokens = self.global_batch * self.seq_len
        return self.flops_per_token * tokens / (self.cluster.devices * self.cluster.peak_flops)

    def _step_parts(
        self, mesh: dict[str, int], sharding: str, remat: str, rows: int, bubble: float, stage_layers: int
    ) -> dict[str, float]:
        compute = self._model_flops_seconds() * RECOMPUTE[remat] / self.kernel_efficiency
        parts = {"compute": compute}
        if bubble:  # idle for that share of the step: compute x bubble / (1 - bubble) seconds
            parts["pipeline bubble"] = compute * bubble / (1 - bubble)
        volumes = self.collective_bytes(mesh, sharding, rows, stage_layers)
        # FSDP's gathers and reduce-scatters, and HSDP's all-reduce, overlap with compute.
        overlapped = volumes.pop("fsdp", 0.0) / self._bandwidth(mesh, "fsdp")
        overlapped += volumes.pop("data", 0.0) / self._bandwidth(mesh, "data")
        parts["fsdp/data exposed"] = max(0.0, overlapped - compute)
        axes = {
            "tensor parallel": "model",
            "context parallel": "seq",
            "expert all-to-all": "expert",
            "pipeline sends": "pipe",
        }
        for name, volume in volumes.items():
            parts[name] = volume / self._bandwidth(mesh, axes[name])
        return parts

    def collective_bytes(self, mesh: dict[str, int], sharding: str, rows: int, stage_layers: int) -> dict[str, float]:
        """Bytes one device sends per step in each kind of collective (ring algorithms), as backend=native runs them.

        The device is the busiest one (``device_elements``'s, with ``sharding``'s specs), ``rows``
        its replica's sequences and ``stage_layers`` the layers it runs.
        """
        model = self.config.model
        width = model.dim
        local = rows * self.seq_len / mesh["seq"]  # tokens of one device: its rows, its slice of each
        volumes = {}
        # FSDP2 shards every parameter it manages (norms too) over fsdp x seq x expert, whatever the
        # specs say, and gathers each whole (as split by the other axes); split over expert, the
        # expert weights are DTensors it leaves alone (fp32: no mixed precision).
        shard_group = mesh["fsdp"] * mesh["seq"] * mesh["expert"]

        def is_expert(name: str) -> bool:
            return mesh["expert"] > 1 and _EXPERT_WEIGHT.search(name) is not None

        unsharded = self._device_parameter_elements(mesh | {"fsdp": 1, "seq": 1, "expert": 1}, sharding)
        managed = sum(n for name, n in unsharded.items() if not is_expert(name))
        experts = sum(n for name, n in self._device_parameter_elements(mesh, sharding).items() if is_expert(name))
        if shard_group > 1:  # gather twice (forward, backward) and reduce-scatter once
            fsdp = (2 * self.gather_bytes + self.reduce_bytes) * managed * (shard_group - 1) / shard_group
            # An expert weight is gathered over fsdp once (backward keeps the forward's), its gradient reduce-scattered.
            volumes["fsdp"] = fsdp + 2 * 4 * experts * (mesh["fsdp"] - 1)
        if mesh["data"] > 1:  # HSDP: all-reduce the shard's gradients across the replicas
            shard = managed / shard_group + experts
            volumes["data"] = 2 * shard * self.reduce_bytes * (mesh["data"] - 1) / mesh["data"]
        if mesh["model"] > 1:
            volumes["tensor parallel"] = self._tensor_parallel_bytes(mesh, sharding, local, stage_layers)
        if mesh["seq"] > 1:  # keys and values gathered forward, their gradients reduced backward
            c = mesh["seq"]
            attention = model.decoder.layer.attention
            kv_width = 2 * attention.resolved_kv_heads() * attention.resolved_head_dim(width)
            volumes["context parallel"] = stage_layers * 3 * local * c * kv_width * self.activation_bytes * (c - 1) / c
        if mesh["expert"] > 1:  # dispatch and combine, forward and backward
            e = mesh["expert"]
            top_k = getattr(getattr(model.decoder.layer.feed_forward, "router", None), "top_k", 1)
            volumes["expert all-to-all"] = (
                stage_layers * 4 * local * top_k * width * self.activation_bytes * (e - 1) / e
            )
        if mesh["pipe"] > 1:
            # Every micro-batch's activations go on to the next stage and their gradients back: an
            # inner stage sends both, each end one of them (the two of a 2-stage pipeline, one each).
            directions = 1 if mesh["pipe"] == 2 else 2
            volumes["pipeline sends"] = directions * local * width * self.activation_bytes
        return volumes

    def _tensor_parallel_bytes(self, mesh: dict[str, int], sharding: str, local: float, stage_layers: int) -> float:
        """What the native backend's tensor parallelism (``NativeBackend._apply_tensor_parallel``) sends per step.

        A row-parallel projection all-reduces its output forward; a column-parallel one its input's
        gradient backward, each on its own (q, k and v: three); the vocab-parallel embedding its
        output. The head's weight is gathered whole for the fused loss (without ``loss.chunk_size``,
        its logits are gathered and its input's gradient all-reduced instead).
        """
        specs = self._resolved(sharding, mesh)

        def split(name: str) -> bool:
            return any(axes and "model" in axes for axes in specs.get(name, ()))

        dim, vocab = self.config.model.dim, self.config.model.vocab_size
        # The embedding's output and the gathered head weight are in the weights' dtype: what FSDP gathers, else fp32.
        fsdp = mesh["data"] * mesh["fsdp"] * mesh["seq"] * mesh["expert"] > 1
        weight_bytes = self.gather_bytes if fsdp else 4
        layer = [name for name in self.shapes if name.startswith("decoder.layers.0.") and name.endswith(".weight")]
        all_reduced = stage_layers * sum(split(name) for name in layer) * local * dim * self.activation_bytes
        all_reduced += split("embedding.weight") * local * dim * weight_bytes
        gathered = 0.0
        if mesh["pipe"] == 1 and split("lm_head.weight"):  # with stages, the head is the last's, not the busiest's
            if self.config.loss.chunk_size is None:
                all_reduced += local * dim * self.activation_bytes
                gathered = local * vocab * self.activation_bytes
            else:
                gathered = vocab * dim * weight_bytes
        t = mesh["model"]
        return (2 * all_reduced + gathered) * (t - 1) / t

    def _bandwidth(self, mesh: dict[str, int], axis: str) -> float:
        """The link an axis's collectives cross: fast when its devices lie within one fast domain."""
        inner = math.prod(mesh[a] for a in MESH_AXES[MESH_AXES.index(axis) :])
        fast = inner <= self.cluster.fast_domain
        return self.cluster.fast_bandwidth if fast else self.cluster.network_bandwidth

    def _resolved(self, sharding: str, mesh: dict[str, int]) -> dict[str, PartitionSpec]:
        key = (sharding, tuple(mesh.values()))
        if key not in self._specs:
            self._specs[key] = resolve_parameter_specs(self.shapes, self.shardings[sharding], mesh)
        return self._specs[key]


def _ways(spec: PartitionSpec, mesh: dict[str, int]) -> int:
    return math.prod(mesh[axis] for axes in spec if axes for axis in axes)


def format_candidates(candidates: Sequence[Candidate], cluster: Cluster, top: int = 5) -> str:
    """The top candidates as a table, why each ranks where it does, and the best as a mesh rule."""
    if not candidates:
        return f"no mesh fits {cluster.hardware} ({cluster.memory_bytes / GIB:.0f} GiB per device)"
    header = "| rank | mesh | sharding | remat | memory/device | est. MFU | step time goes to |"
    rows = [header, "|---|---|---|---|---|---|---|"]
    for rank, c in enumerate(candidates[:top], start=1):
        mesh = " ".join(f"{axis}={size}" for axis, size in c.mesh.items() if size > 1) or "(one device)"
        if c.mesh["pipe"] > 1:
            mesh += f" ({c.microbatches} micro-batches)"
        rows.append(
            f"| {rank} | {mesh} | {c.sharding} | {c.remat} | {c.memory_bytes / GIB:.1f} GiB | {c.mfu:.1%} | {c.why()} |"
        )
    best = candidates[0]
    rule = [
        "mesh rule for the best (conf/mesh_rules/<name>.yaml):",
        "rules:",
        f"  - pattern: '{cluster.hardware}'",
        "    overrides: [" + ", ".join(best.overrides()) + "]",
    ]
    return "\n".join(
        [
            f"{cluster.hardware}: {cluster.devices} devices, {cluster.memory_bytes / GIB:.0f} GiB each; "
            f"{len(candidates)} meshes fit",
            "",
            *rows,
            "",
            *rule,
        ]
    )
