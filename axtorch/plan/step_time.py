"""The search's analytical step time: compute at the chip's peak, plus the communication it cannot hide.

- **compute**: the model's training FLOPs for the global batch (plus what remat recomputes: full
  remat one more forward, selective a tenth) spread over the devices at ``kernel_efficiency`` of
  the device's datasheet peak for ``trainer.precision`` (fp32 or bf16);
- **pipeline bubble**: ``(pipe - 1) / (stages per process x micro-batches)`` of the compute;
- **exposed communication**, from the bytes each collective moves per device and the bandwidth
  of the link it crosses (``Cluster.bandwidth``). FSDP's gathers and reduce-scatters and the
  data-parallel all-reduce (fp32, or bf16 as ``trainer.precision`` says) overlap with compute,
  so only what exceeds it counts; tensor-parallel all-reduces, context-parallel key/value
  gathers, expert all-to-alls and the pipeline stages' sends (activations in the compute dtype)
  sit on the critical path and count whole.

The model ignores kernel launch overheads, stragglers and overlap limits, so its figures are
upper-bound-ish: it is for ranking meshes, not for promising throughput.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Optional

from axtorch.layers.transformer import TransformerLayerConfig
from axtorch.parallel.pipeline_config import PipelineConfig
from axtorch.parallel.sharding import PartitionSpec
from axtorch.plan.cluster import Cluster
from axtorch.plan.memory import process_parameter_names, shard_elements, stage_layers
from axtorch.train.config import Precision
from axtorch.train.experiment import ExperimentConfig

if TYPE_CHECKING:
    from axtorch.train.dry_run import CollectiveCount

#: Forward-and-backward work per remat policy, relative to none.
RECOMPUTE = {"none": 1.0, "selective": 1.1, "full": 4 / 3}
#: A mixture of experts' stacked expert weights, which expert parallelism places itself.
_EXPERT_WEIGHT = re.compile(r"\.feed_forward\.experts\.")
#: The causes of a step's exposed communication, by the mesh axis whose link carries them.
_LINKS = {
    "tensor parallel": "model",
    "context parallel": "seq",
    "expert all-to-all": "expert",
    "pipeline sends": "pipe",
}
_CAUSE_ON = {axis: cause for cause, axis in _LINKS.items()}


class StepTimeModel:
    """Seconds of one step of ``config``'s model on ``cluster``, by cause, for a mesh and its specs."""

    def __init__(
        self,
        config: ExperimentConfig,
        shapes: Mapping[str, tuple[int, ...]],
        cluster: Cluster,
        seq_len: int,
        global_batch: int,
        flops_per_token: float,
        layer_costs: Sequence[int],
        kernel_efficiency: float = 0.7,
    ):
        """``layer_costs``: each decoder layer's cost, which pipeline stages balance (``layer_flops_per_token``)."""
        self.config = config
        self.shapes = shapes
        self.cluster = cluster
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.flops_per_token = flops_per_token
        self.layer_costs = layer_costs
        self.kernel_efficiency = kernel_efficiency
        trainer = config.trainer
        #: The device's peak for the matmuls' precision: MFU's denominator and compute's rate.
        self.peak_flops = cluster.device.peak_flops(trainer.precision.dtype)
        # What FSDP moves per parameter: fp32, or bf16 gathers (and reductions) under trainer.precision=bf16.
        self.gather_bytes = self.activation_bytes = trainer.precision.dtype.itemsize
        self.reduce_bytes = trainer.reduce_precision.dtype.itemsize if trainer.precision is Precision.bf16 else 4

    def model_flops_seconds(self) -> float:
        """The step's model FLOPs at every device's peak: the time MFU compares with."""
        tokens = self.global_batch * self.seq_len
        return self.flops_per_token * tokens / (self.cluster.devices * self.peak_flops)

    def parts(
        self,
        mesh: dict[str, int],
        specs: Mapping[str, PartitionSpec],
        remat: str,
        rows: int,
        bubble: float,
        stage_layers: int,
    ) -> dict[str, float]:
        """Seconds of the step by cause: compute, bubble, and each collective's exposed share."""
        compute = self.model_flops_seconds() * RECOMPUTE[remat] / self.kernel_efficiency
        parts = {"compute": compute}
        if bubble:
            parts["pipeline bubble"] = _idle_seconds(compute, bubble)
        volumes = self.collective_bytes(mesh, specs, rows, stage_layers)
        # FSDP's gathers and reduce-scatters, and HSDP's all-reduce, overlap with compute.
        overlapped = volumes.pop("fsdp", 0.0) / self.cluster.bandwidth(mesh, "fsdp")
        overlapped += volumes.pop("data", 0.0) / self.cluster.bandwidth(mesh, "data")
        parts["fsdp/data exposed"] = max(0.0, overlapped - compute)
        for name, volume in volumes.items():
            parts[name] = volume / self.cluster.bandwidth(mesh, _LINKS[name])
        return parts

    def traced_parts(
        self, mesh: dict[str, int], flops: float, collectives: Sequence[CollectiveCount], bubble: float = 0.0
    ) -> dict[str, float]:
        """Seconds of the step by cause as ``parts`` gives them, from a dry run of the step
        (``axtorch.train.dry_run``) instead of the formulas: the FLOPs it traced on one device
        (recomputation included; with stages, the busiest stage's) at ``kernel_efficiency`` of the
        peak, the pipeline's ``bubble`` as in ``parts``, and each collective's bytes sent
        (``CollectiveCount.sent_bytes``) over the slowest link its group spans. FSDP's gathers and
        reduce-scatters and HSDP's all-reduce overlap with compute, as in ``parts``."""
        compute = flops / (self.peak_flops * self.kernel_efficiency)
        parts = {"compute": compute}
        if bubble:
            parts["pipeline bubble"] = _idle_seconds(compute, bubble)
        overlapped = 0.0
        for collective in collectives:
            axes = collective.axes.split("+") if collective.axes else []
            if not axes:
                continue  # a single device's
            seconds = collective.sent_bytes / min(self.cluster.bandwidth(mesh, axis) for axis in axes)
            cause = _traced_cause(collective.kind, axes)
            if cause is None:
                overlapped += seconds
            else:
                parts[cause] = parts.get(cause, 0.0) + seconds
        parts["fsdp/data exposed"] = max(0.0, overlapped - compute)
        return parts

    def device_parameter_elements(self, mesh: dict[str, int], specs: Mapping[str, PartitionSpec]) -> dict[str, int]:
        """Elements of each parameter the first pipeline process holds (all of them without stages)."""
        pipe, pipeline = mesh["pipe"], PipelineConfig()
        stages = tuple(stage_layers(self.layer_costs, pipe, pipeline))
        names = process_parameter_names(tuple(self.shapes), stages, pipe, pipeline.stages_per_process)[0]
        return shard_elements({name: self.shapes[name] for name in names}, specs, mesh)

    def collective_bytes(
        self, mesh: dict[str, int], specs: Mapping[str, PartitionSpec], rows: int, stage_layers: int
    ) -> dict[str, float]:
        """Bytes one device sends per step in each kind of collective (ring algorithms), as backend=native runs them.

        The device is the busiest one (``device_parameter_elements``'s), ``rows`` its replica's
        sequences and ``stage_layers`` the layers it runs.
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

        unsharded = self.device_parameter_elements(mesh | {"fsdp": 1, "seq": 1, "expert": 1}, specs)
        managed = sum(n for name, n in unsharded.items() if not is_expert(name))
        experts = sum(n for name, n in self.device_parameter_elements(mesh, specs).items() if is_expert(name))
        if shard_group > 1:  # gather twice (forward, backward) and reduce-scatter once
            fsdp = (2 * self.gather_bytes + self.reduce_bytes) * managed * (shard_group - 1) / shard_group
            # An expert weight is gathered over fsdp twice (forward, backward), its gradient reduce-scattered.
            volumes["fsdp"] = fsdp + 3 * 4 * experts * (mesh["fsdp"] - 1)
        if mesh["data"] > 1:  # HSDP: all-reduce the shard's gradients across the replicas
            shard = managed / shard_group + experts
            volumes["data"] = 2 * shard * self.reduce_bytes * (mesh["data"] - 1) / mesh["data"]
        if mesh["model"] > 1:
            volumes["tensor parallel"] = self._tensor_parallel_bytes(mesh, specs, local, stage_layers)
        if mesh["seq"] > 1:  # keys and values gathered forward, their gradients reduced backward
            c = mesh["seq"]
            kv_width = _mean_over_layers(
                model.decoder.layer_configs(),
                lambda layer: 2 * layer.attention.resolved_kv_heads() * layer.attention.resolved_head_dim(width),
            )
            volumes["context parallel"] = stage_layers * 3 * local * c * kv_width * self.activation_bytes * (c - 1) / c
        if mesh["expert"] > 1:  # dispatch and combine, forward and backward
            e = mesh["expert"]
            top_k = _mean_over_layers(
                model.decoder.layer_configs(),
                lambda layer: getattr(getattr(layer.feed_forward, "router", None), "top_k", 1),
            )
            volumes["expert all-to-all"] = (
                stage_layers * 4 * local * top_k * width * self.activation_bytes * (e - 1) / e
            )
        if mesh["pipe"] > 1:
            # Every micro-batch's activations go on to the next stage and their gradients back: an
            # inner stage sends both, each end one of them (the two of a 2-stage pipeline, one each).
            directions = 1 if mesh["pipe"] == 2 else 2
            volumes["pipeline sends"] = directions * local * width * self.activation_bytes
        return volumes

    def _tensor_parallel_bytes(
        self, mesh: dict[str, int], specs: Mapping[str, PartitionSpec], local: float, stage_layers: int
    ) -> float:
        """What the native backend's tensor parallelism (``NativeBackend._apply_tensor_parallel``) sends per step.

        A row-parallel projection all-reduces its output forward; a column-parallel one its input's
        gradient backward, each on its own (q, k and v: three); the vocab-parallel embedding its
        output. The fused loss keeps the head split over its vocabulary and all-reduces each
        token's maximum, sum and target logit (fp32) and the hidden states' gradient (without
        ``loss.chunk_size``, the logits are gathered and their input's gradient all-reduced).
        """

        def split(name: str) -> bool:
            return any(axes and "model" in axes for axes in specs.get(name, ()))

        dim, vocab = self.config.model.dim, self.config.model.vocab_size
        # The embedding's output is in the weights' dtype: what FSDP gathers, else fp32.
        fsdp = mesh["data"] * mesh["fsdp"] * mesh["seq"] * mesh["expert"] > 1
        weight_bytes = self.gather_bytes if fsdp else 4
        layer = [name for name in self.shapes if name.startswith("decoder.layers.0.") and name.endswith(".weight")]
        all_reduced = stage_layers * sum(split(name) for name in layer) * local * dim * self.activation_bytes
        all_reduced += split("embedding.weight") * local * dim * weight_bytes
        gathered = 0.0
        if mesh["pipe"] == 1 and split("lm_head.weight"):  # with stages, the head is the last's, not the busiest's
            all_reduced += local * dim * self.activation_bytes
            if self.config.loss.chunk_size is None:
                gathered = local * vocab * self.activation_bytes
            else:
                all_reduced += local * 3 * 4
        t = mesh["model"]
        return (2 * all_reduced + gathered) * (t - 1) / t


def _mean_over_layers(
    layers: Sequence[TransformerLayerConfig], value: Callable[[TransformerLayerConfig], float]
) -> float:
    """A per-layer quantity averaged over a stack's layers (its variants may differ in it)."""
    return sum(value(layer) for layer in layers) / len(layers)


def _traced_cause(kind: str, axes: list[str]) -> Optional[str]:
    """The cause a traced collective counts under in ``StepTimeModel.parts``' terms; None for what
    overlaps with compute (FSDP's gathers and reduce-scatters, HSDP's all-reduce over ``data``)."""
    if axes == ["model"]:
        return _CAUSE_ON["model"]
    if kind == "all-to-all":
        return _CAUSE_ON["expert"]
    if kind in ("send", "recv"):
        return _CAUSE_ON["pipe"]
    if axes == ["seq"]:  # the keys and values gathered, their gradients reduced
        return _CAUSE_ON["seq"]
    if kind in ("all-gather", "reduce-scatter") and set(axes) <= {"fsdp", "seq", "expert"}:
        return None
    if kind == "all-reduce" and axes == ["data"]:
        return None
    return f"{kind} over {'+'.join(axes)}"


def _idle_seconds(compute: float, bubble: float) -> float:
    """Seconds a pipeline idles for ``bubble`` of its step beside ``compute`` seconds of work."""
    return compute * bubble / (1 - bubble)
