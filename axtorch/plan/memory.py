"""What one device holds while it trains: parameter, gradient and AdamW state, and activations.

One model for ``axtorch-plan``'s report and for the mesh search. Parameters and gradients are
fp32 and AdamW keeps two fp32 moments, each split as its parameter is (``trainer.precision=bf16``
autocasts matmuls only). Activations are held in the compute precision: 4 bytes a value under
fp32, 2 under bf16 autocast (its matmul outputs; norms and residual sums stay fp32, which the
estimate leaves out).

The peak is the larger of two moments the dry run (``axtorch.train.dry_run``) finds: the start of
the backward pass, with every layer's activations, the weights FSDP holds gathered and the fused
head's gradient (no parameter gradient yet: they are set to None after each step), and its end,
with every gradient and no activations.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from axtorch.models.causal_lm import CausalLMConfig
from axtorch.parallel.pipeline_config import PipelineConfig, layer_ranges, stage_parameter_names, stages_of_process
from axtorch.parallel.sharding import NATIVE_FSDP_AXES, PartitionSpec, shard_shape
from axtorch.train.config import Precision

FP32_BYTES = 4
#: Bytes the last pipeline stage's loss holds at its peak per token of a micro-batch and entry of
#: the vocabulary, by compute precision: a stage hands its loss whole logits (the fused head loss
#: does not cross stages), which the loss keeps with their float32 softmax and gradient. Measured
#: with the dry run (``tests/cli/test_plan_check.py`` holds the planner to it on such a stage).
STAGE_LOSS_BYTES = {Precision.fp32: 30, Precision.bf16: 20}


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes on the busiest device: the most parameters any process holds, the first stage's activations."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    #: The root's embedding and output head, gathered whole over the data-parallel axes by FSDP,
    #: under expert parallelism one layer's local experts (gathered for its forward, and again for
    #: its backward), and under pipeline stages with FSDP the whole stage, kept gathered between
    #: each micro-batch's forward and backward.
    gathered_bytes: int = 0
    #: The fused output head's ``[vocab, dim]`` weight gradient (each process's rows under tensor
    #: parallelism), computed in the forward (``axtorch.train.head_cross_entropy``), and under FSDP
    #: a collective buffer as large as the root's embedding and head beside it.
    head_bytes: int = 0

    @property
    def at_backward_start_bytes(self) -> int:
        return (
            self.parameter_bytes + self.optimizer_bytes + self.activation_bytes + self.gathered_bytes + self.head_bytes
        )

    @property
    def at_backward_end_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        """The peak: the larger of the two moments."""
        return max(self.at_backward_start_bytes, self.at_backward_end_bytes)


def shard_elements(
    shapes: Mapping[str, tuple[int, ...]], specs: Mapping[str, PartitionSpec], mesh_sizes: Mapping[str, int]
) -> dict[str, int]:
    """Elements of each parameter one device holds, split by its spec."""
    # Every layer repeats the same few (shape, spec) pairs: size each pair once.
    sizes: dict[tuple[tuple[int, ...], PartitionSpec], int] = {}
    for name, shape in shapes.items():
        key = (shape, specs[name])
        if key not in sizes:
            sizes[key] = math.prod(shard_shape(shape, specs[name], mesh_sizes))
    return {name: sizes[(shape, specs[name])] for name, shape in shapes.items()}


def native_fsdp_specs(
    shapes: Mapping[str, tuple[int, ...]], specs: Mapping[str, PartitionSpec], mesh_sizes: Mapping[str, int]
) -> dict[str, PartitionSpec]:
    """``specs`` as the native backend applies them: FSDP2 splits each parameter that expert
    parallelism does not place, on the dimension its spec gives ``fsdp`` (else the first), over
    ``fsdp`` x ``seq`` x ``expert``, where a preset's spec names ``fsdp`` alone (under xla it means
    that axis only): llama-style weights on fsdp=8 x expert=8 are split 64 ways, not 8. A dimension
    that would not split evenly (FSDP pads it) keeps its spec's count."""
    axes = tuple(axis for axis in NATIVE_FSDP_AXES if mesh_sizes.get(axis, 1) > 1)
    native = dict(specs)
    for name, spec in specs.items():
        shape = shapes[name]
        if not axes or not shape or any(entry and "expert" in entry for entry in spec):
            continue  # nothing to split over, a scalar, or placed by expert parallelism (FSDP leaves it)
        dim = next((i for i, entry in enumerate(spec) if entry and "fsdp" in entry), 0)
        entry = tuple(axis for axis in (spec[dim] or ()) if axis != "fsdp") + axes
        if shape[dim] % math.prod(mesh_sizes[axis] for axis in entry) == 0:
            native[name] = (*spec[:dim], entry, *spec[dim + 1 :])
    return native


def stage_layers(layer_costs: Sequence[int], pipe: int, pipeline: PipelineConfig) -> list[range]:
    """Each pipeline stage's layers, split by ``layer_costs`` (``layer_flops_per_token``) as a run
    splits them (one stage of all of them without ``mesh.pipe``)."""
    if pipe == 1:
        return [range(len(layer_costs))]
    return layer_ranges(layer_costs, pipeline.num_stages(pipe), pipeline.split_points)


@functools.lru_cache(maxsize=64)
def process_parameter_names(
    names: tuple[str, ...], stages: tuple[range, ...], pipe: int, stages_per_process: int
) -> tuple[tuple[str, ...], ...]:
    """The parameters each process of a ``pipe`` group holds: its stages' (all of them without stages).

    Cached: the search asks for the same split of the same model for every mesh.
    """
    if pipe == 1:
        return (names,)
    owned = [stages_of_process(rank, pipe, stages_per_process) for rank in range(pipe)]
    return tuple(tuple(stage_parameter_names(names, list(stages), process)) for process in owned)


def parameter_elements(
    shapes: Mapping[str, tuple[int, ...]],
    specs: Mapping[str, PartitionSpec],
    mesh_sizes: Mapping[str, int],
    layer_costs: Sequence[int],
    pipeline: PipelineConfig,
) -> int:
    """Parameter elements on the busiest device: the most that any process's stages hold, split by ``specs``."""
    pipe = mesh_sizes.get("pipe", 1)
    stages = tuple(stage_layers(layer_costs, pipe, pipeline))
    shards = shard_elements(shapes, specs, mesh_sizes)
    held = process_parameter_names(tuple(shapes), stages, pipe, pipeline.stages_per_process)
    return max(sum(shards[name] for name in names) for names in held)


def device_memory(
    model: CausalLMConfig,
    elements: int,
    mesh_sizes: Mapping[str, int],
    precision: Precision,
    batch: int,
    seq_len: int,
    pipeline: PipelineConfig,
    layer_costs: Sequence[int],
    microbatches: int = 1,
    keeps_weights_gathered: bool = False,
) -> DeviceMemory:
    """What the busiest device holds: ``elements`` (``parameter_elements``) in fp32 state, and activations.

    ``batch`` is sequences per device in one micro-batch. Under ``mesh.pipe`` the first process
    holds the most micro-batches in flight (``pipeline.microbatches_in_flight``) of its layers'
    activations, the last its loss's whole logits (``STAGE_LOSS_BYTES``): the fuller of the two.

    ``keeps_weights_gathered``: the xla backend's one SPMD program, where the TPU compiler gathers
    each weight over ``fsdp`` once and keeps it whole until the backward has used it too, where
    FSDP2 frees it after the forward and gathers it again (its buffer assignment holds 0.81 GiB
    more a layer of Llama 3 8B at fsdp=64, one layer's fp32 weights; with or without remat).
    """
    pipe = mesh_sizes.get("pipe", 1)
    layers = model.decoder.num_layers
    # Context parallelism gives each device a slice of every sequence.
    seq = seq_len // mesh_sizes.get("seq", 1)
    activations: float = activation_bytes(model, batch, seq, mesh_sizes.get("model", 1), precision)
    if pipe > 1:
        # The first process holds the most micro-batches in flight; the last, fewer (one under
        # 1F1B) beside its loss's whole logits: the larger of the two.
        stages = stage_layers(layer_costs, pipe, pipeline)

        def held_layers(process: int) -> int:
            return sum(len(stages[stage]) for stage in stages_of_process(process, pipe, pipeline.stages_per_process))

        first = activations * held_layers(0) / layers * pipeline.microbatches_in_flight(pipe, microbatches)
        last_in_flight = microbatches if pipeline.schedule == "gpipe" else 1
        logits = batch * seq * model.vocab_size * STAGE_LOSS_BYTES[precision]
        last = activations * held_layers(pipe - 1) / layers * last_in_flight + logits
        activations = max(first, last)
    # Expert parallelism (never with stages): each layer's returned rows, and its experts gathered whole.
    expert = mesh_sizes.get("expert", 1)
    layer_configs = model.decoder.layer_configs() if expert > 1 else []
    held = [layer.feed_forward.expert_parallel_held(model.dim, expert) for layer in layer_configs]
    activations += precision.dtype.itemsize * batch * seq * sum(width for width, _ in held)
    tensor_parallel = mesh_sizes.get("model", 1)
    vocab_by_dim = model.vocab_size * model.dim
    head_weights = vocab_by_dim * (1 if model.tie_embeddings else 2)  # the embedding and the head
    data_parallel = math.prod(mesh_sizes.get(axis, 1) for axis in ("data", "fsdp", "expert"))
    gathered = head_weights / tensor_parallel if data_parallel > 1 and pipe == 1 else 0
    if mesh_sizes.get("fsdp", 1) > 1:  # split over fsdp, one layer's experts are gathered at a time
        gathered += max((elements for _, elements in held), default=0)
    # The fused loss's head gradient: each process's vocabulary rows under tensor parallelism
    # (axtorch/parallel/vocab_shards.py), and beside it, data-parallel, the buffer its reduction
    # takes: under FSDP2 a collective buffer as large as the root's embedding and head (the dry
    # run finds it at the peak: llama3_8b on fsdp=64 at 64 x 256, 3.91 GiB of collective buffers
    # beside the head's 1.96 GiB gradient), in XLA's program a copy of the head's. An adapter
    # freezes the head; under stages it is the last process's, not the first (the busiest).
    frozen_or_elsewhere = model.adapter is not None or pipe > 1
    reduced = vocab_by_dim if keeps_weights_gathered else head_weights
    head_gradient = vocab_by_dim + (reduced if data_parallel > 1 else 0)
    head = 0 if frozen_or_elsewhere else head_gradient / tensor_parallel
    # A stage's FSDP units have no root above them, so each keeps its weights gathered (in the
    # compute precision) from a micro-batch's forward to its backward, as torchtitan's stages do:
    # at the first backward, the process's whole stage, over fsdp.
    fsdp = mesh_sizes.get("fsdp", 1)
    stage_gathered = elements * fsdp * precision.dtype.itemsize if pipe > 1 and fsdp > 1 else 0
    if keeps_weights_gathered and fsdp > 1:  # every weight whole over fsdp, the embedding and head among them
        gathered = max(gathered, elements * fsdp)
    return DeviceMemory(
        parameter_bytes=FP32_BYTES * elements,
        gradient_bytes=FP32_BYTES * elements,
        optimizer_bytes=2 * FP32_BYTES * elements,
        activation_bytes=round(activations),
        gathered_bytes=round(FP32_BYTES * gathered + stage_gathered),
        head_bytes=round(FP32_BYTES * head),
    )


def activation_bytes(model: CausalLMConfig, batch: int, seq: int, tensor_parallel: int, precision: Precision) -> int:
    """Activations the model keeps for the backward pass on one device, in ``precision``'s bytes.

    Each layer keeps what its config declares (``TransformerLayerConfig.saved_width``: its norms,
    attention and feed-forward, each measured against the dry run of a layer of its kind), per
    token of sequence ``seq`` and per-device batch ``batch``; the model adds its final norm's and
    the fused head's gradient with respect to the hidden states. Attention's kernels keep O(s)
    state (SDPA's fused kernels; on CUDA, grouped heads are repeated where SDPA would fall back to
    its O(s^2) math kernel: ``axtorch.layers.attention_kernel``). Under ``model/remat=full`` only
    each layer's input (``s*b*h`` values) is kept, plus one layer's full set while it is
    recomputed; ``selective`` adds the named activations it keeps, as wide as the layers declare
    (``TransformerLayerConfig.activation_widths``: a mixture of experts keeps ``top_k`` experts' hidden).
    Not counted: the keys and values that context parallelism gathers.
    """
    value_bytes = precision.dtype.itemsize
    tokens, h, t = seq * batch, model.dim, tensor_parallel
    layers = model.decoder.layer_configs()
    head_width = h + (model.decoder.final_norm or model.decoder.layer.norm).saved_width(h)
    remat = model.decoder.remat
    if remat is None:
        kept_width = sum(layer.saved_width(h, t) for layer in layers)
        return round(value_bytes * tokens * (kept_width + head_width))
    saved: Iterable[str] = list(getattr(remat, "save", ()))
    # Each layer's own declaration (a name a layer does not give keeps nothing of it).
    kept_width = sum(h + sum(layer.activation_widths(h, t).get(name, 0.0) for name in saved) for layer in layers)
    recomputed = max(layer.saved_width(h, t) for layer in layers)
    return round(value_bytes * tokens * (kept_width + recomputed + head_width))
