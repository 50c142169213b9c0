"""What the trainer needs from a backend: a device, the data-parallel slice, and reductions.

The trainer is written once against this interface; ``single`` implements it trivially and the
distributed backends implement it over a device mesh. Layers never see a backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
from torch import nn

from axtorch.models.causal_lm import CausalLM
from axtorch.parallel.side_channel import Coordinator, GlooSideChannel
from axtorch.parallel.tensor_shards import Piece, copy_into_local_block, owned_pieces

if TYPE_CHECKING:  # torch.distributed.pipelining only where a pipeline runs
    from axtorch.parallel.pipeline import Pipeline


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
    #: Runs the training and evaluation micro-batches through this process's pipeline stages
    #: (``mesh.pipe > 1``); None: the trainer runs the model itself.
    pipeline: Optional[Pipeline]

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
    pipeline: Optional[Pipeline] = None

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
