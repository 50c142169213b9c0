"""What the trainer needs from a backend: a device, the data-parallel slice, reductions, and how a
step's micro-batches run (``StepRunner``: through the whole model, or through pipeline stages).

The trainer is written once against this interface; ``single`` implements it trivially and the
distributed backends implement it over a device mesh. Layers never see a backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Optional, Protocol

import torch
from torch import nn

from axtorch.models.causal_lm import CausalLM
from axtorch.parallel.side_channel import Coordinator, GlooSideChannel
from axtorch.parallel.tensor_shards import Piece, copy_into_local_block, owned_pieces

#: A micro-batch on the device: ``input_ids`` and ``labels`` [b, S], and what the loader adds
#: (``positions``, ``segment_ids``).
MicroBatch = dict[str, torch.Tensor]

#: ``(logits [b, S, V], labels [b, S]) -> (loss to differentiate, cross-entropy sum, target count)``.
MicroBatchLoss = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class MicroBatchSteps(Protocol):
    """The trainer's work on micro-batches, in the forms a ``StepRunner`` chooses from."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context of the forwards."""

    def train_whole_model(self, micro_batches: list[MicroBatch], num_targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch through the whole model; their cross-entropy, summed.

        ``num_targets`` is the global batch's target count, which every micro-batch's loss divides by.
        """

    def evaluate_whole_model(self, micro_batch: MicroBatch) -> torch.Tensor:
        """``[cross-entropy sum, tokens]`` (float64) of one held-out micro-batch through the whole model."""

    def stage_loss(self, num_targets: Optional[torch.Tensor]) -> MicroBatchLoss:
        """The loss that a last pipeline stage takes of its logits (``num_targets``: None in evaluation)."""


class StepRunner(Protocol):
    """How this process runs a step's micro-batches: the trainer's one seam for pipeline parallelism.

    The default, ``WholeModel``, hands them to the trainer's whole-model steps; a pipeline
    (``axtorch.parallel.pipeline.Pipeline``, ``mesh.pipe > 1``) runs them through this process's
    stages on its schedule, with the trainer's loss on the last stage.
    """

    #: Whether this process trains the whole model (False: only its pipeline stages' modules).
    holds_whole_model: bool

    def prepare(self, rows_per_replica: int) -> None:
        """Get ready for steps of ``rows_per_replica`` rows per data-parallel replica."""

    def train(self, micro_batches: list[MicroBatch], num_targets: torch.Tensor, steps: MicroBatchSteps) -> torch.Tensor:
        """Forward and backward of a step's micro-batches; this replica's cross-entropy, summed."""

    def evaluate(self, micro_batch: MicroBatch, steps: MicroBatchSteps) -> Optional[torch.Tensor]:
        """``[cross-entropy sum, tokens]`` of one held-out micro-batch; None: one this runner cannot run."""


class WholeModel:
    """The ``StepRunner`` of a process that holds the whole model: the trainer's own steps, unchanged."""

    holds_whole_model = True

    def prepare(self, rows_per_replica: int) -> None:
        pass

    def train(self, micro_batches: list[MicroBatch], num_targets: torch.Tensor, steps: MicroBatchSteps) -> torch.Tensor:
        return steps.train_whole_model(micro_batches, num_targets)

    def evaluate(self, micro_batch: MicroBatch, steps: MicroBatchSteps) -> Optional[torch.Tensor]:
        return steps.evaluate_whole_model(micro_batch)


class Backend(Protocol):
    #: Where this process computes.
    device: torch.device
    #: This process among all of the job's processes.
    rank: int
    world_size: int
    #: Index and count of the data-parallel replicas that take different rows of a batch.
    data_parallel_rank: int
    data_parallel_size: int
    #: Gradients arrive divided by this (data-parallel averaging); the trainer scales the loss by it
    #: so that the loss, already divided by the global token count, yields summed gradients.
    gradient_divisor: int
    #: Whether this process writes the run directory's shared files (config, metrics, plots).
    is_main_process: bool
    #: How many of the step's devices (``num_devices``) each process drives.
    devices_per_process: int
    #: Runs a step's micro-batches: ``WholeModel``, or this process's pipeline stages (``mesh.pipe > 1``).
    runner: StepRunner

    # Read-only (an implementation may derive them), so declared as properties.
    @property
    def device_name(self) -> str:
        """The chip as its runtime names it ("cpu", "NVIDIA H100 80GB HBM3", "TPU v5 lite"): picks the MFU peak."""

    @property
    def num_devices(self) -> int:
        """Devices that run one step together."""

    def parallelize(self, model: CausalLM) -> CausalLM:
        """Shard a model built on the meta device; returns the module to train.

        Parameters hold no values yet: ``materialize`` fills them, one at a time.
        """

    def fill_parameter(self, model: nn.Module, name: str, value: torch.Tensor) -> None:
        """Give parameter ``name`` its full host ``value``; this process keeps only its own block."""

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Create or place optimizer state where the backend needs it before the first step."""

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply ``optimizer``'s update to every parameter (its gradients are final)."""

    def run_traced(self) -> None:
        """Run the work traced since the last call as one program, before the host reads its results.

        XLA traces lazily: reading a value (the loss, the gradient norm) runs just the graph that
        value needs, and whatever else the step still needs later is traced and run again. Cut
        here, each piece (forward and backward, the optimizer update, an evaluation batch) runs
        once and compiles once. Eager backends have nothing pending.
        """

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Move a host batch (rows first) to the device(s), split as the backend's data axes say.

        A backend that splits sequences over processes (context parallelism) keeps this
        process's tokens of each row and adds their absolute ``positions`` [B, S_local].
        """

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel replicas (identity on one device)."""

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: Optional[float]) -> torch.Tensor:
        """Clip gradients in place to a global L2 norm (None: no clipping); return the norm before clipping."""

    def barrier(self) -> None:
        """Wait for every process."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, in rank order, on every process."""

    def owned_pieces(self, tensor: torch.Tensor) -> list[Piece]:
        """The blocks of ``tensor`` this process writes into a checkpoint."""

    def side_channel(self) -> Coordinator:
        """A coordinator for a background thread, independent of the training's collectives.

        Asked for only when there are several processes, by all of them at the same point: it
        creates a process group.
        """

    def close(self) -> None:
        """Release communicators."""


def materialize(
    backend: Backend, model: nn.Module, values: Iterable[tuple[str, torch.Tensor]], whole_model: bool = True
) -> None:
    """Fill every parameter of a parallelized model from ``(name, full host value)`` pairs, streamed.

    A process never holds more than the current value in full plus its own blocks, so a model
    larger than one host's memory initialises (or imports) as long as its shards fit. Unless
    ``model`` is the whole model, values of parameters it lacks (other pipeline stages') are skipped.
    """
    pending = {name for name, _ in model.named_parameters()}
    filled: set[str] = set()
    for name, value in values:
        if name not in pending:
            if whole_model or name in filled:
                raise KeyError(f"a value for {name!r}, which is not a parameter of the model (or came twice)")
            continue
        backend.fill_parameter(model, name, value)
        pending.discard(name)
        filled.add(name)
    if pending:
        raise RuntimeError(f"no value for parameters {sorted(pending)[:5]} ({len(pending)} in all)")


def ec2_instance_type() -> Optional[str]:
    """The EC2 instance type (``trn1.32xlarge``), which Nitro instances report as their DMI product
    name; it names the Trainium generation (untested here: no Trainium machine)."""
    product = Path("/sys/devices/virtual/dmi/id/product_name")
    return product.read_text().strip() if product.is_file() else None


def host_device_name(device: torch.device) -> str:
    """The name of an eagerly fed device: the CUDA/ROCm product name, Trainium's instance type, else the type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "neuron":
        return ec2_instance_type() or "neuron"
    return device.type


class HostFedBackend:
    """Shared behaviour of backends whose processes each feed their own device eagerly."""

    device: torch.device
    rank: int
    world_size: int
    devices_per_process = 1
    runner: StepRunner = WholeModel()

    @property
    def device_name(self) -> str:
        return host_device_name(self.device)

    @property
    def num_devices(self) -> int:
        return self.world_size

    def fill_parameter(self, model: nn.Module, name: str, value: torch.Tensor) -> None:
        copy_into_local_block(model.get_parameter(name), value)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        pass  # optimizer state is created lazily, in the parameters' own layout

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def run_traced(self) -> None:
        pass

    def owned_pieces(self, tensor: torch.Tensor) -> list[Piece]:
        return owned_pieces(tensor, self.rank)

    def side_channel(self) -> Coordinator:
        return GlooSideChannel()
