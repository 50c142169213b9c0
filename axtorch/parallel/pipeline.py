"""Pipeline parallelism for the native backend: the decoder's layers split into stages over ``pipe``.

Each process of a ``pipe`` group keeps only its stages' modules of the model (the first stage the
embedding, the last the final norm and the head), under their original names, so checkpoints
stay those of the whole model. A step's rows go through the stages as micro-batches, scheduled
by ``torch.distributed.pipelining`` (GPipe, 1F1B or interleaved 1F1B, which gives each process
several stages, ``stages_per_process``), and the last stage takes the loss.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from axtorch.layers.transformer import TransformerLayerInput
from axtorch.models.causal_lm import CausalLM, default_positions
from axtorch.parallel.backend import MicroBatch, MicroBatchLoss, MicroBatchSteps
from axtorch.parallel.pipeline_config import PipelineConfig

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class _LayerSubset(nn.ModuleDict):
    """Some of a decoder's layers, keyed by their index in the whole decoder (so names keep it)."""

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]  # layers, as a ModuleList yields
        return iter(self.values())


def keep_stages(model: CausalLM, ranges: list[range], stages: list[int]) -> CausalLM:
    """A copy of ``model`` (on the meta device) with only the modules of ``stages``."""
    with unset_fake_temporarily():  # a meta copy, as the model was built, also in a dry run's fake mode
        part = copy.deepcopy(model)
    kept = sorted(index for stage in stages for index in ranges[stage])
    part.decoder.layers = cast(nn.ModuleList, _LayerSubset({str(i): part.decoder.layers[i] for i in kept}))
    if 0 not in stages:
        part.embedding = cast(Any, None)
        part.position_embedding = None
    if len(ranges) - 1 not in stages:
        part.decoder.final_norm = cast(Any, None)
        part.lm_head = None
    return part


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose first handshake with its neighbours also works on gloo with torch 2.9,
    and which, where no neighbour answers (a dry run's fake process group), takes the shapes it was given.

    torch 2.9 greets each neighbour before the first step with an int64 scalar sent into the
    neighbour's float32[1] buffer; NCCL does not check sizes, gloo aborts (``op.preamble.length <=
    op.nbytes. 8 vs 4``). Newer torch sends float32, and there this changes nothing. With no
    neighbours there is no one to greet. Newer torch also has the stages vote on whether every one
    was given its shapes (``_warmup_p2p``) and reads the count the neighbours send back: with no
    neighbours, a stage given its shapes votes alone.
    """

    def __init__(self, *args: Any, peers_answer: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.peers_answer = peers_answer

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        if not self.peers_answer:
            return []  # the handshake warms a real run's communicators once, before any step
        ops = super()._get_init_p2p_neighbors_ops()
        for op in ops:
            op.tensor = op.tensor.float()
        return ops

    def _warmup_forward_vote(self, has_backward: bool, received_acc: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.peers_answer:
            return super()._warmup_forward_vote(has_backward, received_acc)
        return _shapes_given()

    def _warmup_backward_result(self, received_result: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.peers_answer:
            return super()._warmup_backward_result(received_result)
        return _shapes_given()


def _shapes_given() -> torch.Tensor:
    """The vote "every stage was given its shapes". The schedule reads its value: made from data, it
    keeps it under fake tensors too (a fake tensor of one element made from a value holds it)."""
    return torch.tensor([1], dtype=torch.int32)


def _alike(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    return (tensor.shape, tensor.dtype) == (other.shape, other.dtype)


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s shape and dtype on the meta device (outside any fake mode: no values, no memory),
    with a gradient if it is a float: a stage's output does in training (its example ran without)."""
    with unset_fake_temporarily():
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta", requires_grad=tensor.is_floating_point())


class StageModule(nn.Module):
    """One stage's forward, over the modules of ``model`` (a process's part): a tensor in, a tensor out.

    The first stage takes token ids and embeds them; the last returns logits. Positions are
    0..S-1 (the pipeline does not split sequences) unless the micro-batch has its own: rows that
    pack documents (``data.document_masking``) restart them in each, and their ``segment_ids``
    keep attention within a document. Those two reach every stage beside its activations, as
    keyword arguments of the schedule, which cuts them into the same micro-batches as the rows.
    """

    def __init__(self, model: CausalLM, layers: range, first: bool, last: bool):
        super().__init__()
        self.model = model
        self.layer_names = [str(index) for index in layers]
        self.first = first
        self.last = last

    def forward(
        self, inputs: torch.Tensor, positions: Optional[torch.Tensor] = None, segment_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        if positions is None:
            positions = default_positions(inputs[..., 0] if not self.first else inputs)
        hidden = self.model.embed(inputs, positions) if self.first else inputs
        decoder = self.model.decoder
        for name in self.layer_names:
            layer = cast(nn.ModuleDict, decoder.layers)[name]
            layer_input = TransformerLayerInput(hidden, positions, segment_ids=segment_ids)
            hidden = decoder.run_layer(layer, layer_input).hidden_states
        return self.model.project(decoder.final_norm(hidden)) if self.last else hidden


#: What a micro-batch may hold besides ``input_ids`` and ``labels``, which every stage takes.
STAGE_KEYWORDS = ("positions", "segment_ids")


class Pipeline:
    """Runs one process's stages through a schedule, for training steps and for evaluation.

    The ``StepRunner`` of a backend with ``mesh.pipe > 1``: a step is one micro-batch list that
    the schedule splits, and the trainer's loss runs on the last stage.
    """

    holds_whole_model = False

    def __init__(
        self,
        model: CausalLM,
        config: PipelineConfig,
        ranges: list[range],
        stage_indices: list[int],
        group: dist.ProcessGroup,
        device: torch.device,
    ):
        """``model`` holds this process's ``stage_indices`` of the stages whose layers are ``ranges``."""
        self.config = config
        self.pipe = dist.get_world_size(group)
        self.num_stages = len(ranges)
        self.stage_indices = stage_indices
        self.group = group
        self.device = device
        self.modules = [
            StageModule(model, ranges[index], first=index == 0, last=index == self.num_stages - 1)
            for index in self.stage_indices
        ]
        self.has_first = 0 in self.stage_indices
        self.has_last = self.num_stages - 1 in self.stage_indices
        self.microbatches = 0  # known once ``prepare`` has the rows
        #: False in a world of no peers (a dry run's fake process group): the stages are then given
        #: their tensors' shapes up front (``shape_stages``), since no neighbour can tell them.
        self.peers_answer = dist.get_backend(group) != "fake"
        #: Each stage's example input and output (meta tensors), where the peers do not answer.
        self._shapes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._loss_fn: Optional[MicroBatchLoss] = None
        self._sums: list[torch.Tensor] = []

    def prepare(self, rows_per_replica: int) -> None:
        """Build the schedules for steps of ``rows_per_replica`` rows (checked against the config);
        where the peers do not answer, ``shape_stages`` builds them."""
        self.config.validate(self.pipe, self.modules[0].model.config.decoder.num_layers, rows_per_replica)
        self.microbatches = self.config.resolved_microbatches(self.pipe, rows_per_replica)
        if self.peers_answer:
            self._build_schedules()

    def shape_stages(
        self, micro_batch: MicroBatch, steps: MicroBatchSteps, handed_on: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """Give each stage its input's and output's shapes up front, then build the schedules: in a
        world of no peers, where torch cannot ask the neighbours.

        The first stage takes a micro-batch of ``micro_batch``'s token ids; every other stage the
        hidden states another stage hands on, ``handed_on`` (a meta tensor: what the first stage
        returned here, in the process that holds it). Each stage's output is its own forward's, run
        once without gradients on an example. Returns the hidden states this process's stages hand
        on (the first stage's output where it holds it, else ``handed_on``).
        """
        rows = len(micro_batch["input_ids"]) // self.microbatches
        keywords = {key: micro_batch[key][:rows] for key in STAGE_KEYWORDS if key in micro_batch}
        for module, index in zip(self.modules, self.stage_indices):
            if module.first:
                example = micro_batch["input_ids"][:rows]
            elif handed_on is None:
                raise ValueError(f"stage {index} takes hidden states from another process's stage: pass handed_on")
            else:
                example = torch.empty(handed_on.shape, dtype=handed_on.dtype, device=self.device)
            with torch.no_grad(), steps.autocast():
                output = module(example, **keywords)
            for part in module.modules():  # FSDP's root keeps its gathered weights after a forward
                if isinstance(part, FSDPModule):
                    part.reshard()
            if module.first and not module.last:
                handed_on = _meta_like(output)
            elif not module.last and handed_on is not None and not _alike(output, handed_on):
                raise ValueError(
                    f"stage {index} hands on {output.dtype} {tuple(output.shape)}, but it was handed "
                    f"{handed_on.dtype} {tuple(handed_on.shape)}: the stages disagree on the hidden states"
                )
            self._shapes[index] = (_meta_like(example), _meta_like(output))
        self._build_schedules()
        assert handed_on is not None
        return handed_on

    def _build_schedules(self) -> None:
        # Training and evaluation each get their own stages: torch 2.9 does not prepare a stage
        # for backward once it has run without (newer torch re-prepares it at every switch).
        self.training_schedule = self._schedule()
        self.evaluation_schedule = self._schedule()

    def train(self, micro_batches: list[MicroBatch], num_targets: torch.Tensor, steps: MicroBatchSteps) -> torch.Tensor:
        """The schedule runs the forwards and backwards of the step's rows (one micro-batch list)."""
        (micro_batch,) = micro_batches
        with steps.autocast():
            sums = self.run(micro_batch, steps.stage_loss(num_targets), train=True)
        return sums[0].float()

    def evaluate(self, micro_batch: MicroBatch, steps: MicroBatchSteps) -> Optional[torch.Tensor]:
        """None for a short last batch, which the schedule's micro-batches cannot split."""
        if len(micro_batch["input_ids"]) % self.microbatches:
            return None
        with steps.autocast():
            return self.run(micro_batch, steps.stage_loss(None), train=False)

    def _schedule(self) -> Any:
        stages = [
            _Stage(
                module,
                index,
                self.num_stages,
                self.device,
                *self._shapes.get(index, (None, None)),
                group=self.group,
                peers_answer=self.peers_answer,
            )
            for module, index in zip(self.modules, self.stage_indices)
        ]
        stage_or_stages = stages if self.config.schedule == "interleaved_1f1b" else stages[0]
        # The micro-batch losses are already shares of the global batch's loss: summed, not averaged.
        schedule_class = SCHEDULES[self.config.schedule]
        return schedule_class(stage_or_stages, self.microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        loss, cross_entropy_sum, targets = self._loss_fn(logits, labels)
        self._sums.append(torch.stack([cross_entropy_sum.detach().double(), targets.double()]))
        return loss

    def run(self, micro_batch: MicroBatch, loss_fn: MicroBatchLoss, train: bool) -> torch.Tensor:
        """Every micro-batch through the stages (with backward when ``train``): ``[cross-entropy sum, targets]``.

        The sums are the last stage's, handed to every stage of the group.
        """
        self._loss_fn, self._sums = loss_fn, []
        args = (micro_batch["input_ids"],) if self.has_first else ()
        target = micro_batch["labels"] if self.has_last else None
        keywords = {key: micro_batch[key] for key in STAGE_KEYWORDS if key in micro_batch}
        if train:
            self.training_schedule.step(*args, target=target, **keywords)
        else:
            self.evaluation_schedule.eval(*args, target=target, **keywords)
        # Newer torch calls the loss once more before the first step's micro-batches, to infer
        # the shapes of the backward.
        last = self._sums[-self.microbatches :]
        sums = (torch.stack(last).sum(0) if last else torch.zeros(2, dtype=torch.float64)).to(self.device)
        dist.all_reduce(sums, group=self.group)  # only the last stage's are non-zero
        return sums
