"""The ``xla`` backend: torch_xla SPMD (GSPMD) over the same mesh and sharding rules.

One process per host drives all of its devices (which host it is comes from ``xla_hosts``, where
a simulation on one machine can set it); parameters are annotated with
``xs.mark_sharding`` from the resolved parameter specs, activations at the block boundaries named
by the activation rules (through forward hooks, so layers stay unaware), and the compiler inserts
the collectives. The same code path serves TPUs (``PJRT_DEVICE=TPU``), Trainium through
torch-neuronx (``PJRT_DEVICE=NEURON``, untested here) and CPU virtual devices
(``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N``, used by the tests).

torch_xla is imported only when this backend is chosen, and it must be the torch_xla built for
the installed torch (2.9.0 for torch_xla 2.9.0: the ``xla`` extra).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from axtorch.config.errors import ConfigError
from axtorch.layers.seams import fill_seams
from axtorch.layers.transformer import LayerRunner
from axtorch.models.causal_lm import CausalLM
from axtorch.parallel.backend import StepRunner, WholeModel, ec2_instance_type
from axtorch.parallel.execution import ExecutionConfig, LayerRunnerKind
from axtorch.parallel.mesh import MeshConfig
from axtorch.parallel.optimizer_state import create_adamw_state
from axtorch.parallel.sharding import PartitionSpec, ShardingConfig, resolve_activation_specs, resolve_parameter_specs
from axtorch.parallel.side_channel import Coordinator, GlooSideChannel
from axtorch.parallel.tensor_shards import Piece
from axtorch.parallel.xla_hosts import XlaHosts, xla_hosts

try:
    import torch_xla
    import torch_xla.core.xla_builder as xb
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
except ImportError as error:  # pragma: no cover - exercised only without torch_xla
    raise ImportError(
        "backend=xla needs torch_xla matching torch (pip install 'axtorch[xla]': torch==2.9.0, torch_xla==2.9.0)"
    ) from error

# After the check above: it imports torch_xla itself.
from axtorch.parallel.xla_scan import LayerScan

#: AdamW's state that is shaped like its parameter.
MOMENTS = ("exp_avg", "exp_avg_sq")


def _xla_spec(spec: PartitionSpec) -> tuple:
    """axtorch's spec (None or a tuple of axis names per dim) in torch_xla's form."""
    return tuple(None if axes is None else (axes[0] if len(axes) == 1 else axes) for axes in spec)


class XlaBackend:
    gradient_divisor = 1  # one global program: the loss is already the global mean
    runner: StepRunner = WholeModel()  # no stages: the config refuses mesh.pipe > 1 with backend=xla

    def __init__(
        self,
        mesh: MeshConfig,
        sharding: ShardingConfig,
        execution: ExecutionConfig,
        traced_devices: Optional[int] = None,
    ):
        """``traced_devices``: a dry run's backend, which traces the step for that many devices and
        runs nothing: every parameter, moment and batch a placeholder that holds no data (see
        ``place_without_values``), on whatever devices this process's runtime has (one suffices)."""
        xr.use_spmd()
        self.device = torch_xla.device()
        _register_rng_module()
        self.holds_values = traced_devices is None
        num_devices = traced_devices or xr.global_runtime_device_count()
        self.sizes = mesh.resolve(num_devices, "mesh")
        self.sharding = sharding
        self.execution = execution
        axis_names = tuple(self.sizes)
        dcn = mesh.resolve_dcn(self.sizes)
        #: HLO sharding text of each placeholder a dry run traces, by torch_xla's tensor id.
        self.placeholder_shardings: dict[int, str] = {}
        if not self.holds_values:
            self.mesh = _TracedMesh(num_devices, tuple(self.sizes.values()), axis_names)
        elif any(size > 1 for size in dcn.values()):
            # Multi-slice: each axis spans ICI within a slice times DCN across slices.
            ici = tuple(self.sizes[axis] // dcn[axis] for axis in axis_names)
            self.mesh = xs.HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=tuple(dcn.values()), axis_names=axis_names)
        else:
            self.mesh = xs.Mesh(np.arange(num_devices), tuple(self.sizes.values()), axis_names)
        one_host = XlaHosts(0, 1)  # a dry run's: it traces the whole program, as one host would compile it
        self.hosts = xla_hosts(lambda: (xr.process_index(), xr.process_count())) if self.holds_values else one_host
        self.rank = self.hosts.index
        self.world_size = self.hosts.count
        self.num_devices = num_devices
        self.devices_per_process = num_devices // self.world_size
        self.device_name = xla_device_name()
        self.hosts.check_feedable(self.sizes)
        if self.world_size > 1 and not dist.is_initialized():
            # Host-side coordination (barriers, checkpoint piece lists, preemption) over gloo.
            importlib.import_module("torch_xla.distributed.xla_backend")  # registers xla://
            dist.init_process_group("gloo", init_method=self.hosts.init_method)
        # Each host feeds its own rows of the global batch; within a host, sharding splits them.
        self.data_parallel_rank = self.rank
        self.data_parallel_size = self.world_size
        self.is_main_process = self.rank == 0
        self.parameter_specs: dict[str, PartitionSpec] = {}
        #: Fills the decoders' layer-runner seam under ``execution.layer_runner=scan``; None otherwise.
        self.layer_scan: Optional[LayerScan] = None

    def parallelize(self, model: CausalLM) -> CausalLM:
        """Resolve the specs and hook the activations; parameters stay on the meta device until filled."""
        self.parameter_specs = resolve_parameter_specs(
            {name: tuple(p.shape) for name, p in model.named_parameters()}, self.sharding, self.sizes
        )
        modules = dict(model.named_modules())
        activation_specs = resolve_activation_specs(modules, self.sharding, self.sizes)
        for (module_name, io, field), spec in activation_specs.items():
            self._hook_activation(modules[module_name], io, field, _xla_spec(spec))
        if self.execution.layer_runner is LayerRunnerKind.scan:
            runner = LayerScan(cut=self.run_traced)
            self.layer_scan = runner if fill_seams(model, LayerRunner, runner) else None
        return model

    def fill_parameter(self, model: nn.Module, name: str, value: torch.Tensor) -> None:
        """Send ``value`` to the devices split by its spec, so that each device receives only its block."""
        self._place(model, name, self._send_sharded(value, _xla_spec(self.parameter_specs[name])))

    def place_without_values(self, model: nn.Module) -> None:
        """Every parameter a placeholder of its shape, annotated with its spec: an argument of the
        traced program that holds no data (a dry run traces the step on them and never runs it)."""
        for name, param in list(model.named_parameters()):
            self._place(model, name, self._placeholder(param.shape, param.dtype, self.parameter_specs[name]))

    def _placeholder(self, shape: torch.Size, dtype: torch.dtype, spec: PartitionSpec | tuple) -> torch.Tensor:
        """A tensor the traced program takes as an argument, split by ``spec``, with no buffer behind it."""
        data = xb.create_placeholder_tensor(tuple(shape), dtype)
        # A placeholder has no data to reshard: the annotation is the program's, as on an activation.
        torch_xla._XLAC._xla_annotate_custom_sharding(data, self.mesh.get_op_sharding(_xla_spec(tuple(spec))))
        self.placeholder_shardings[torch_xla._XLAC._xla_get_tensor_id(data)] = torch_xla._XLAC._get_xla_sharding_spec(
            data
        )
        return data

    def _place(self, model: nn.Module, name: str, data: torch.Tensor) -> None:
        module_name, _, param_name = name.rpartition(".")
        frozen = not model.get_parameter(name).requires_grad  # a frozen base (model/adapter) stays frozen
        model.get_submodule(module_name).register_parameter(param_name, nn.Parameter(data, requires_grad=not frozen))

    def _send_sharded(self, value: torch.Tensor, spec: tuple, minibatch: bool = False) -> torch.Tensor:
        """``value`` on the devices split by ``spec``, each device receiving only its block when it can.

        ``minibatch``: ``value`` is this host's block of rows, and the tensor is every host's together.
        """
        if minibatch or sum(axes is not None for axes in spec) <= 1:
            sharding = xs.ShardingSpec(self.mesh, spec, minibatch=minibatch)
            (data,) = xm.send_cpu_data_to_device([value.contiguous()], self.device, sharding)
            return data
        # torch_xla 2.9's sharded transfer fails ("too many indices") for a spec that splits two
        # dimensions: send the whole value, then reshard it on the devices.
        data = value.to(self.device)
        xs.mark_sharding(data, self.mesh, spec)
        return data

    def _hook_activation(self, module: nn.Module, io: str, field: str, spec: tuple) -> None:
        def annotate(value: Any) -> None:
            tensor = getattr(value, field, None)
            if tensor is None:
                raise ConfigError(
                    "sharding.activations",
                    field,
                    f"a tensor field of {type(value).__name__}",
                    reason=f"{type(module).__name__}'s {io} has no tensor field {field!r}",
                )
            if is_fake(tensor):
                # Tracing a scanned layer: the compiler propagates shardings from the stacked
                # weights and the carry there, and an annotation cannot be placed on a fake tensor.
                return
            xs.mark_sharding(tensor, self.mesh, spec)

        if io == "input":
            module.register_forward_pre_hook(lambda mod, args: annotate(args[0]))
        else:
            module.register_forward_hook(lambda mod, args, output: annotate(output))

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Create AdamW's moments up front, sharded like their parameters (not replicated)."""
        self.annotate_optimizer_state(optimizer)
        # Zeros on the device now, not traced into the first update: its program is then the
        # same as every later step's, compiled once.
        self.run_traced()

    def annotate_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """AdamW's moments, made lazily and annotated with their parameters' specs."""
        specs_by_param = {}
        for group in optimizer.param_groups:
            for name, param in zip(group["names"], group["params"]):
                specs_by_param[param] = self.parameter_specs[name]
        for param in create_adamw_state(optimizer):
            for key in MOMENTS:
                if self.holds_values:
                    xs.mark_sharding(optimizer.state[param][key], self.mesh, _xla_spec(specs_by_param[param]))
                else:  # arguments of the traced program, as in every step after the first
                    optimizer.state[param][key] = self._placeholder(param.shape, param.dtype, specs_by_param[param])

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self.layer_scan is not None:
            self.layer_scan.step_optimizer(optimizer)
        else:
            optimizer.step()

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Transfer each tensor already split as MpDeviceLoader does: rows over the data-parallel
        axes, and each sequence over ``seq`` (context parallelism, which GSPMD then carries through
        attention, gathering keys and values where it needs them).

        ``batch`` holds this host's rows. On several hosts each sends them to its own devices, and
        the runtime takes the global batch to be the hosts' rows in host order (``minibatch``). A
        simulation's runtime holds every device, so the hosts assemble that same global batch
        from each other's rows over gloo and each sends it whole.
        """
        data_axes = tuple(axis for axis in ("data", "fsdp") if self.sizes[axis] > 1) or None
        seq_axis = "seq" if self.sizes["seq"] > 1 else None
        minibatch = self.world_size > 1 and not self.hosts.simulated
        if not self.holds_values:
            return {
                key: self._placeholder(tensor.shape, tensor.dtype, (data_axes, seq_axis) + (None,) * (tensor.dim() - 2))
                for key, tensor in batch.items()
            }
        if self.hosts.simulated:
            batch = {key: torch.cat(self.all_gather_object(tensor)) for key, tensor in batch.items()}
        return {
            key: self._send_sharded(tensor, (data_axes, seq_axis) + (None,) * (tensor.dim() - 2), minibatch)
            for key, tensor in batch.items()
        }

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # SPMD tensors are already global

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: Optional[float]) -> torch.Tensor:
        if self.layer_scan is not None:
            return self.layer_scan.clip_grad_norm(parameters, max_norm)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm is not None else math.inf)

    def run_traced(self) -> None:
        """Compile and run what was traced; a dry run's backend (``traced_devices``) runs nothing."""
        if self.holds_values:
            torch_xla.sync()

    def traced_program(self, results: list[torch.Tensor]) -> TracedProgram:
        """The StableHLO of the pending graph with ``results`` as its outputs, and each of its
        arguments' origin: the id of the placeholder it is (None: a scalar or constant the trace made)."""
        ids, _ = torch_xla._XLAC._get_tensors_xla_device_data_node(results)
        text = torch_xla._XLAC._get_stablehlo(results, torch_xla._XLAC._xla_get_default_device(), [], False)
        return TracedProgram(text.decode(), [None if tensor_id < 0 else tensor_id for tensor_id in ids])

    @staticmethod
    def tensor_id(tensor: torch.Tensor) -> int:
        return int(torch_xla._XLAC._xla_get_tensor_id(tensor))

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def side_channel(self) -> Coordinator:
        return GlooSideChannel()

    def owned_pieces(self, tensor: torch.Tensor) -> list[Piece]:
        """One piece per distinct block held by this host's devices: no host gathers a whole tensor,
        and the hosts together write each block once (its first replica's host writes it)."""
        # The step's program runs asynchronously after sync(); a shard read while it is in flight is an
        # error, not a wait (a full-tensor .cpu() would wait). Waiting is free once the step has finished.
        xm.wait_device_ops()
        wrapped = xs.wrap_if_sharded(tensor)
        if not isinstance(wrapped, xs.XLAShardedTensor):  # unannotated (a step count): whole on every host
            if self.rank != 0:
                return []
            return [Piece(tensor.detach().cpu().contiguous(), tuple(tensor.shape), (0,) * tensor.dim())]
        # On a pod a host sees only its own devices' shards; a simulated host sees all of them.
        own_devices = self.hosts.device_block(self.num_devices) if self.hosts.simulated else None
        pieces = []
        for shard in wrapped.local_shards:
            if shard.replica_id != 0 or (own_devices is not None and _device_id(shard.shard_device) not in own_devices):
                continue
            whole = shard.indices is Ellipsis  # a replicated annotation: every device holds it all
            offsets = (0,) * tensor.dim() if whole else tuple(index.start or 0 for index in shard.indices)
            pieces.append(Piece(shard.data.contiguous(), tuple(tensor.shape), offsets))
        return pieces

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


class _XlaRandomState:
    """What ``torch.utils.checkpoint`` looks up as ``torch.xla`` to save and restore the device's RNG
    around a recomputed layer (``model/remat``): torch_xla 2.9 registers no such module, and without
    one every remat policy but the scan's failed (``module 'torch' has no attribute 'xla'``). Under
    SPMD torch sees one XLA device, whatever index it names; its seed is the program's."""

    _initialized = True

    @staticmethod
    def device(device: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_rng_state(device: Any = None) -> int:
        return xm.get_rng_state()

    @staticmethod
    def set_rng_state(state: int, device: Any = None) -> None:
        xm.set_rng_state(state)


def _register_rng_module() -> None:
    if "torch.xla" not in sys.modules:  # once a process
        torch._register_device_module("xla", _XlaRandomState)


@dataclass
class TracedProgram:
    """One traced SPMD program as torch_xla lowers it, and where each of its arguments comes from."""

    stablehlo: str
    #: Per argument: the tensor id of the placeholder it stands for; None for what the trace made
    #: itself (a scalar such as the learning rate, a constant index).
    argument_ids: list[Optional[int]]


def start_tracing_runtime() -> None:
    """Start torch_xla on one virtual CPU device unless its runtime already runs: a dry run's
    backend (``traced_devices``) traces for any device count on a runtime of any size.

    One device, not the mesh's: torch's autograd engine keeps a queue per device of a kind, indexed
    by an 8-bit ``c10::DeviceIndex``, and fails an internal assert on 128 XLA devices or more.
    """
    if not torch_xla._XLAC._xla_runtime_is_initialized():
        os.environ["PJRT_DEVICE"] = "CPU"
        os.environ["CPU_NUM_DEVICES"] = "1"


class _TracedMesh(xs.Mesh):
    """A mesh of ``devices`` device ids that the runtime need not hold: a dry run's annotations only.

    ``xs.Mesh`` asserts that its ids are the runtime's own; every other use of a mesh (its
    partition specs' HLO shardings) reads only the ids, the shape and the axis names set here.
    """

    def __init__(self, devices: int, shape: tuple[int, ...], axis_names: tuple[str, ...]):  # no super(): its assert
        self.device_ids = np.arange(devices)
        self.mesh_shape = shape
        self.axis_names = axis_names


def program_split(tensor: torch.Tensor) -> Optional[tuple[int, ...]]:
    """Ways the traced program splits each dimension of ``tensor``, read from its HLO sharding
    annotation (``{devices=[4,1]0,1,2,3}``, with a last tile dimension of replicas or not;
    ``{replicated}``); None where it carries none."""
    text = torch_xla._XLAC._get_xla_sharding_spec(tensor)
    if not text:
        return None
    tiles = re.search(r"devices=\[([\d,]+)\]", text)
    if tiles is None:  # replicated, or on one device
        return (1,) * tensor.dim()
    ways = tuple(int(count) for count in tiles.group(1).split(","))
    return ways[: tensor.dim()]  # a last tile dimension of replicas, if any, splits nothing


def _device_id(shard_device: str) -> int:
    """The global ordinal in a shard's device name (``CPU:5``, ``TPU:3``)."""
    return int(shard_device.rpartition(":")[2])


def decode_device() -> tuple[torch.device, Callable[[], None]]:
    """This host's XLA device, and the graph cut that makes each decode step one program.

    Passed as ``step_boundary`` to ``axtorch.infer.decoding``: cut after every step, the steps'
    graphs are identical (static shapes, positions on the device), so XLA compiles the decode
    step once and reuses it; uncut, the lazy graph would grow across steps, a new program each time.
    """
    return torch_xla.device(), torch_xla.sync


def xla_device_name() -> str:
    """The chip's name for the MFU table: the PJRT device type, and on TPU the generation.

    Under SPMD the one virtual device has no kind of its own, so the name comes from the runtime's
    device type; a TPU VM's generation (``v5litepod``, ``v5p``, ``v6e``) from its metadata, as
    torch_xla reads it (untested here: no TPU), and a Trainium host's from its instance type.
    """
    kind = xr.device_type() or "unknown"
    if kind == "CPU":
        return "cpu"
    if kind == "TPU":
        try:
            from torch_xla._internal import tpu

            return f"TPU {tpu.get_tpu_type()}"
        except Exception:  # no metadata server: the chip stays unnamed, MFU is omitted
            return "TPU"
    if kind == "NEURON":
        return ec2_instance_type() or "neuron"
    return kind


def local_shard_shapes(tensor: torch.Tensor) -> list[tuple[int, ...]]:
    """Shapes of the per-device pieces of an XLA tensor (for tests and reports)."""
    wrapped = xs.wrap_if_sharded(tensor)
    if not isinstance(wrapped, xs.XLAShardedTensor):  # no annotation: every device holds it whole
        return [tuple(tensor.shape)] * xr.global_runtime_device_count()
    return [tuple(shard.data.shape) for shard in wrapped.local_shards]
