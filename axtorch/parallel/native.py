"""The ``native`` backend: torch.distributed over a DeviceMesh built from the mesh config.

Sharding comes from the resolved parameter specs (``axtorch.parallel.sharding``), applied from outside
the model:

- tensor parallelism over ``model``: a linear whose weight splits its output dim over ``model`` is
  column-parallel (replicated input, output left split over features), one that splits its input
  dim is row-parallel (split input, partial sums all-reduced); an embedding split over the vocab
  is a vocab-parallel lookup. A column-parallel projection at the model's top level (the LM head)
  gathers its output, since the loss needs whole logits.
- FSDP2 (``fully_shard``) over ``data`` x ``fsdp``: each transformer layer and the root are
  sharded on the dimension the spec assigns to ``fsdp`` (HSDP: replicated over ``data``).
- context parallelism over ``seq``: each process takes a balanced slice of every sequence's
  tokens and attention gathers the group's keys and values (``axtorch.parallel.context``).
  FSDP then shards over ``fsdp`` x ``seq`` together, as torchtitan does, which also sums the
  gradients that the ``seq`` peers compute for the same weights.
- expert parallelism over ``expert``: a mixture of experts' stacked weights split whole experts
  over ``expert`` and, as their spec says, rows over ``fsdp`` (DTensors that FSDP leaves alone),
  and tokens travel to their experts' processes and back by all-to-all
  (``axtorch.parallel.experts``). Outside the experts ``expert`` is data-parallel: it takes
  different rows, and FSDP shards the other weights over ``fsdp`` x ``expert``.
- pipeline parallelism over ``pipe`` (outermost): each process keeps only its stages' modules
  and runs micro-batches through a ``torch.distributed.pipelining`` schedule
  (``axtorch.parallel.pipeline``); everything above applies within each stage.

Runs under ``torchrun`` with gloo on CPU and NCCL on CUDA; ``device_type`` may name another
accelerator with a torch.distributed backend (e.g. TorchNeuron's native device).
"""

from __future__ import annotations

import importlib
import math
import os
import warnings
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from axtorch.config.errors import ConfigError
from axtorch.layers.attention import SequenceExchange
from axtorch.layers.embedding import Embedding
from axtorch.layers.mixture_of_experts import ExpertCompute
from axtorch.layers.seams import fill_seams, modules_with_seam
from axtorch.models.causal_lm import CausalLM
from axtorch.parallel.backend import HostFedBackend, StepRunner, WholeModel
from axtorch.parallel.context import GatheredSequence, split_sequence
from axtorch.parallel.experts import ExpertParallelCompute
from axtorch.parallel.mesh import MeshConfig
from axtorch.parallel.pipeline_config import PipelineConfig, layer_ranges, stages_of_process
from axtorch.parallel.sharding import NATIVE_FSDP_AXES, PartitionSpec, ShardingConfig, resolve_parameter_specs
from axtorch.parallel.tensor_shards import Piece, owned_pieces

#: Device types that exist only once their plugin is imported (untested here: not installable).
_DEVICE_PLUGINS = {"neuron": "torch_neuronx"}


class NativeBackend(HostFedBackend):
    def __init__(
        self,
        mesh: MeshConfig,
        sharding: ShardingConfig,
        device_type: str = "cpu",
        pipeline: Optional[PipelineConfig] = None,
        gather_dtype: Optional[torch.dtype] = None,
        reduce_dtype: Optional[torch.dtype] = None,
        layer_costs: Optional[Sequence[int]] = None,
    ):
        """``layer_costs``: each decoder layer's cost, which pipeline stages balance (``layer_ranges``;
        None: the layers cost the same)."""
        if device_type in _DEVICE_PLUGINS:
            importlib.import_module(_DEVICE_PLUGINS[device_type])  # registers the device and its collectives
        if not dist.is_initialized():
            # gloo on CPU, NCCL on CUDA; for another device type (e.g. TorchNeuron's) torch picks
            # the process-group backend that device registered (untested here).
            _init_process_group({"cpu": "gloo", "cuda": "nccl"}.get(device_type))
        self.sizes = mesh.resolve(dist.get_world_size(), "mesh")
        if any(slices > 1 for slices in mesh.resolve_dcn(self.sizes).values()):
            raise ConfigError(
                "mesh.dcn",
                "(set)",
                "all 1 with backend=native",
                reason="DCN slices describe multi-slice TPU meshes (backend=xla); span nodes with mesh.data",
            )
        if device_type == "cpu":
            self.device = torch.device("cpu")
        else:
            self.device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", 0)))
            getattr(torch, device_type).set_device(self.device)
        self.sharding = sharding
        self.mesh: DeviceMesh = init_device_mesh(
            device_type, tuple(self.sizes.values()), mesh_dim_names=tuple(self.sizes)
        )
        own_coordinate = self.mesh.get_coordinate()
        if own_coordinate is None:  # cannot happen: init_device_mesh spans every rank
            raise RuntimeError(f"rank {dist.get_rank()} is not in its own device mesh")
        coordinate = dict(zip(self.sizes, own_coordinate))
        # Rows of the batch go to data x fsdp x expert replicas (the expert axis is data-parallel
        # outside the experts), in that axis order.
        self.data_parallel_size = self.sizes["data"] * self.sizes["fsdp"] * self.sizes["expert"]
        replica = coordinate["data"] * self.sizes["fsdp"] + coordinate["fsdp"]
        self.data_parallel_rank = replica * self.sizes["expert"] + coordinate["expert"]
        self.seq_rank = coordinate["seq"]
        self.pipe_rank = coordinate["pipe"]
        self.pipeline_config = pipeline or PipelineConfig()
        self.layer_costs = layer_costs
        # Parameters stay fp32 in their shards (the optimizer's); FSDP casts what it gathers.
        self.mixed_precision = MixedPrecisionPolicy(param_dtype=gather_dtype, reduce_dtype=reduce_dtype)
        self.runner: StepRunner = WholeModel()  # a Pipeline once ``parallelize`` keeps this process's stages
        #: Placed by expert parallelism; FSDP leaves them alone.
        self._expert_parameters: set[nn.Parameter] = set()
        self.gradient_divisor = 1
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.is_main_process = self.rank == 0
        # This process among those of its pipeline stage (pipe is the outermost axis).
        self.stage_rank = self.rank - self.pipe_rank * (self.world_size // self.sizes["pipe"])

    # -------------------------------------------------------------------------------- sharding

    def parallelize(self, model: CausalLM) -> CausalLM:
        """Shard ``model``; under pipeline parallelism, a copy of this process's stages only."""
        specs = resolve_parameter_specs(
            {name: tuple(p.shape) for name, p in model.named_parameters()}, self.sharding, self.sizes
        )
        pipe = self.sizes["pipe"]
        if pipe > 1:
            # torch.distributed.pipelining imports torch._dynamo: 0.4 s of every native process's
            # start-up (four per torchrun test), needed by pipelines only.
            from axtorch.parallel.pipeline import Pipeline, keep_stages

            config = self.pipeline_config
            costs = self.layer_costs or [1] * model.config.decoder.num_layers
            ranges = layer_ranges(costs, config.num_stages(pipe), config.split_points)
            stages = stages_of_process(self.pipe_rank, pipe, config.stages_per_process)
            model = keep_stages(model, ranges, stages)
        if self.sizes["model"] > 1:
            self._apply_tensor_parallel(model, specs)
        if self.sizes["seq"] > 1:
            self._apply_context_parallel(model)
        if self.sizes["expert"] > 1:
            self._apply_expert_parallel(model, specs)
        if self.data_parallel_size * self.sizes["seq"] > 1:
            self._apply_fsdp(model, specs)
        # Only now is storage allocated: each rank's own shards, never the whole model.
        model = model.to_empty(device=self.device)
        if pipe > 1:
            group = self.mesh["pipe"].get_group()
            self.runner = Pipeline(model, self.pipeline_config, ranges, stages, group, self.device)
        return model

    def _apply_tensor_parallel(self, model: CausalLM, specs: dict[str, PartitionSpec]) -> None:
        tp_mesh = self.mesh["model"]
        for module_name, module in model.named_modules():
            weight_spec = specs.get(f"{module_name}.weight") if module_name else None
            if weight_spec is None or not any(axes and "model" in axes for axes in weight_spec):
                continue
            dim = next(i for i, axes in enumerate(weight_spec) if axes and "model" in axes)
            is_embedding = isinstance(module, Embedding)
            if is_embedding and model.config.tie_embeddings:
                raise ConfigError(
                    "model.tie_embeddings",
                    True,
                    "false with tensor parallelism over mesh.model",
                    reason="a tied, vocab-parallel table cannot also serve as the output head yet",
                )
            placed = (module, module_name, specs, tp_mesh)
            if is_embedding:
                _distribute(*placed, inputs=Replicate(), outputs=Replicate())
            elif dim == 0:  # column-parallel
                gather = module is model.lm_head  # the output head: the loss needs whole logits
                _distribute(*placed, inputs=Replicate(), outputs=Replicate() if gather else Shard(-1))
            else:  # row-parallel
                _distribute(*placed, inputs=Shard(-1), outputs=Replicate())

    def _apply_context_parallel(self, model: nn.Module) -> None:
        fill_seams(model, SequenceExchange, GatheredSequence(self.mesh["seq"].get_group()))

    def _apply_expert_parallel(self, model: nn.Module, specs: dict[str, PartitionSpec]) -> None:
        """Split each stacked expert weight, whole experts over ``expert``; route tokens by all-to-all."""
        mesh = self.mesh["data", "fsdp", "expert"]
        # FSDP scales the other gradients by 1 / its mesh size; the experts' are summed (``Partial``).
        compute = ExpertParallelCompute(mesh, gradient_scale=1 / self._fsdp_mesh_size())
        for module_name, module, _ in modules_with_seam(model, ExpertCompute):  # any mixture of experts
            experts = module.get_submodule("experts")  # the stacked weights ExpertCompute receives
            for param_name, param in list(experts.named_parameters(recurse=False)):
                name = f"{module_name}.experts.{param_name}"
                spec = specs[name]
                if not spec[0] or "expert" not in spec[0]:
                    raise ConfigError(
                        "sharding",
                        f"{name}: {list(spec)}",
                        "a preset splitting the expert dimension over expert (sharding=fsdp_ep)",
                        reason="mesh.expert > 1 needs each expert whole on one process of the expert axis",
                    )
                fsdp_dim = next((i for i, axes in enumerate(spec) if axes and "fsdp" in axes), None)
                placements = [Replicate(), Replicate() if fsdp_dim is None else Shard(fsdp_dim), Shard(0)]
                tensor = distribute_tensor(param, mesh, placements)  # a frozen base (model/adapter) stays frozen
                experts.register_parameter(param_name, nn.Parameter(tensor, requires_grad=param.requires_grad))
                self._expert_parameters.add(experts.get_parameter(param_name))
        fill_seams(model, ExpertCompute, compute)

    def _fsdp_mesh_size(self) -> int:
        return self.data_parallel_size * self.sizes["seq"]

    def _sharding_mesh(self, *shard_axes: str) -> DeviceMesh:
        """FSDP's mesh: ``shard_axes`` (flattened into one when several are above 1) to shard over,
        ``data`` to replicate over."""
        axes = [axis for axis in shard_axes if self.sizes[axis] > 1] or ["fsdp"]
        if len(axes) == 1:
            shard = axes[0]
            return self.mesh["data", shard] if self.sizes["data"] > 1 else self.mesh[shard]
        shard = "_".join(axes)
        flat = self.mesh[tuple(axes)]._flatten(shard)
        if self.sizes["data"] == 1:
            return flat
        with warnings.catch_warnings():
            # torch >= 2.11 warns that slicing a flattened dim from the root mesh will go away;
            # it works through 2.13, the newest torch axtorch supports.
            warnings.filterwarnings("ignore", "Slicing a flattened dim", UserWarning)
            return self.mesh["data", shard]

    def _apply_fsdp(self, model: CausalLM, specs: dict[str, PartitionSpec]) -> None:
        dp_mesh = self._sharding_mesh(*NATIVE_FSDP_AXES)
        dims = {}
        for name, param in model.named_parameters():
            spec = specs[name]
            dims[param] = next((i for i, axes in enumerate(spec) if axes and "fsdp" in axes), 0)

        def placement(param: nn.Parameter) -> Shard:
            return Shard(dims.get(param, 0))

        ignored = self._expert_parameters or None
        mp = self.mixed_precision
        for layer in model.decoder.layers:
            fully_shard(layer, mesh=dp_mesh, shard_placement_fn=placement, ignored_params=ignored, mp_policy=mp)
        if self.sizes["pipe"] > 1:
            # A stage calls the embedding and the head itself, not the root's forward: each is its own unit.
            tops = [model.embedding, model.position_embedding, model.decoder.final_norm, model.lm_head]
            for module in tops:
                if module is not None and any(True for _ in module.parameters()):
                    fully_shard(module, mesh=dp_mesh, shard_placement_fn=placement, mp_policy=mp)
        else:
            # The root too reshards after each forward, so that evaluation (no backward) leaves every
            # parameter sharded, as the plan and the checkpoint expect.
            fully_shard(
                model,
                mesh=dp_mesh,
                shard_placement_fn=placement,
                reshard_after_forward=True,
                ignored_params=ignored,
                mp_policy=mp,
            )
        # FSDP averages gradients over its mesh (a custom divide factor needs PREMUL_SUM, which
        # gloo lacks); the trainer cancels the average by scaling the loss.
        self.gradient_divisor = dp_mesh.size()

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Under tensor parallelism without FSDP, step each parameter on its own.

        Norms then stay plain tensors beside DTensor weights, which the optimizers' multi-tensor
        (foreach) kernels cannot mix.
        """
        if self.sizes["model"] > 1 and self.data_parallel_size == 1:
            for group in optimizer.param_groups:
                group["foreach"] = False

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.sizes["seq"] > 1:
            batch = split_sequence(batch, self.sizes["seq"], self.seq_rank)
        return super().to_device(batch)

    # ------------------------------------------------------------------------------ reductions

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel replicas and the sequence slices.

        Reduced over the whole world, then divided by the tensor-parallel and pipeline degrees:
        those peers of a replica hold identical values, so the quotient is exact for counts.
        """
        if dist.get_world_size() == 1:
            return tensor
        reduced = tensor.clone()
        dist.all_reduce(reduced)
        copies = self.sizes["model"] * self.sizes["pipe"]
        return reduced // copies if not reduced.is_floating_point() else reduced / copies

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: Optional[float]) -> torch.Tensor:
        """Global L2 norm over every shard of every gradient, by one all-reduce, then in-place clipping.

        Each process sums the squares of the gradient shards it holds, each divided by how many
        processes hold that same shard (its copies over the mesh dimensions it is not split on),
        so one sum over all processes counts every element once, as torchtitan's clipping over
        DTensors does: not one all-reduce per parameter.
        """
        grads = [p.grad for p in parameters if p.grad is not None]
        holders = self.world_size // self.sizes["pipe"]  # the processes of one stage: its parameters' holders
        by_copies: dict[int, list[torch.Tensor]] = {}
        for grad in grads:
            local, copies = _shard_and_copies(grad, holders)
            by_copies.setdefault(copies, []).append(local)
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for copies, shards in by_copies.items():
            norms = torch._foreach_norm([shard.float() for shard in shards])
            squares += torch.stack(norms).double().square().sum() / copies
        dist.all_reduce(squares)
        total = squares.sqrt()
        if max_norm is not None and math.isfinite(max_norm):
            scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for grad in grads:
                by_dtype.setdefault(grad.dtype, []).append(grad.to_local() if isinstance(grad, DTensor) else grad)
            for dtype, locals_ in by_dtype.items():
                torch._foreach_mul_(locals_, scale.to(dtype))
        return total.float()

    def owned_pieces(self, tensor: torch.Tensor) -> list[Piece]:
        """As every host-fed backend's, but a stage's first process owns its stage's whole tensors."""
        return owned_pieces(tensor, self.stage_rank)

    def barrier(self) -> None:
        dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_process_group(backend: Optional[str]) -> None:
    """Join the job's process group, on store keys of this torchrun attempt only.

    torchrun's workers share its rendezvous store, which outlives an in-place restart
    (``--max-restarts``) with the previous attempt's gloo and NCCL addresses still in it: a
    restarted worker that read one would connect to a dead process. A per-attempt key prefix
    keeps the attempts apart. Outside torchrun's shared store, torch's own env:// setup is used.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend)
        return
    shared = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=default_pg_timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"axtorch/attempt_{attempt}", shared),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def _model_placement(spec: PartitionSpec) -> Shard | Replicate:
    """A parameter's placement over the ``model`` axis: split on the dimension its spec assigns to ``model``."""
    dim = next((i for i, axes in enumerate(spec) if axes and "model" in axes), None)
    return Replicate() if dim is None else Shard(dim)


def _distribute(
    module: nn.Module, module_name: str, specs: dict[str, PartitionSpec], mesh: DeviceMesh, *, inputs, outputs
) -> None:
    """Shard ``module``'s parameters over ``mesh`` as their specs say and convert its tensor input/output.

    Its children's too: a LoRA adapter (``Linear.adapter``) splits with its base (``conf/sharding/fsdp_tp.yaml``)
    and runs on the same DTensor input. A frozen parameter stays frozen.
    """

    def partition(name: str, mod: nn.Module, device_mesh: DeviceMesh) -> None:
        prefix = f"{module_name}.{name}" if name else module_name
        for param_name, param in list(mod.named_parameters(recurse=False)):
            placement = _model_placement(specs[f"{prefix}.{param_name}"])
            tensor = distribute_tensor(param, device_mesh, [placement])
            mod.register_parameter(param_name, nn.Parameter(tensor, requires_grad=param.requires_grad))

    def prepare_input(mod, args, device_mesh):
        (x,) = args
        return DTensor.from_local(x, device_mesh, [inputs], run_check=False)

    def prepare_output(mod, output, device_mesh):
        if output.placements[0] != outputs:
            output = output.redistribute(device_mesh, [outputs])
        return output.to_local()

    distribute_module(module, mesh, partition, prepare_input, prepare_output)


def _shard_and_copies(grad: torch.Tensor, holders: int) -> tuple[torch.Tensor, int]:
    """This process's shard of ``grad`` and how many of the stage's ``holders`` hold the same shard.

    A DTensor split over some of its mesh's dimensions has ``holders`` / (their sizes' product)
    copies of each shard; a plain tensor is whole on every holder. A partial sum (not expected of
    a gradient after FSDP's reduce-scatter) is summed first, and is then whole everywhere.
    """
    if not isinstance(grad, DTensor):
        return grad, holders
    if any(placement.is_partial() for placement in grad.placements):
        return grad.full_tensor(), holders
    mesh = grad.device_mesh
    shards = math.prod(mesh.size(dim) for dim, placement in enumerate(grad.placements) if placement.is_shard())
    return grad.to_local(), holders // shards
