"""One optimizer step's work on this replica's rows, apart from the loop around it.

The trainer runs it on real batches; a dry run (``axtorch.train.dry_run``) on fake tensors. Both
run the same forward, loss, backward, clipping and update, so what a dry run measures (memory,
collectives, FLOPs) is the real step's.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from axtorch.data.loader import Batch
from axtorch.parallel.backend import Backend, MicroBatchLoss
from axtorch.train.config import Precision
from axtorch.train.experiment import ExperimentConfig
from axtorch.train.loss import CrossEntropyLoss, LossInput, LossOutput, forward_with_loss


@dataclass
class TrainStep:
    """The backend's ``MicroBatchSteps`` for one model, loss and optimizer, and the step around them."""

    config: ExperimentConfig
    backend: Backend
    model: nn.Module
    loss_fn: CrossEntropyLoss
    optimizer: torch.optim.Optimizer
    #: Rows of a micro-batch: this replica's rows of a step over ``trainer.grad_accum_steps``.
    micro_batch_size: int

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast of the forwards under ``trainer.precision=bf16``; nothing under fp32."""
        enabled = self.config.trainer.precision is Precision.bf16
        return torch.autocast(self.backend.device.type, dtype=torch.bfloat16, enabled=enabled)

    def micro_batches(self, batch: Batch) -> list[Batch]:
        """This replica's rows, cut into micro-batches on the device."""
        return [
            self.backend.to_device({k: v[i : i + self.micro_batch_size] for k, v in batch.items()})
            for i in range(0, len(batch["input_ids"]), self.micro_batch_size)
        ]

    def gradients(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward and clipping over ``batch`` (this replica's rows of the global batch):
        the global batch's summed cross-entropy and the global gradient norm, both still on the device.

        Every micro-batch's summed loss is divided by the target count of the whole global batch,
        so accumulation and data parallelism weigh every token the same as one big batch would.
        The backend's runner runs the micro-batches (``train_whole_model``, or pipeline stages).
        """
        micro_batches = self.micro_batches(batch)
        local_targets = functools.reduce(
            operator.add, ((mb["labels"] != self.config.loss.ignore_index).sum() for mb in micro_batches)
        )
        num_targets = self.backend.all_reduce_sum(local_targets)
        total_loss = self.backend.runner.train(micro_batches, num_targets, self)
        grad_norm = self.backend.clip_grad_norm(list(self.model.parameters()), self.config.optim.grad_clip_norm)
        return self.backend.all_reduce_sum(total_loss), grad_norm

    @property
    def skips_on_device(self) -> bool:
        """Whether the optimizer drops an update by a flag on the device (fused AdamW's ``found_inf``:
        no parameter, moment or step count changes), so the host need not read the step first."""
        return bool(self.optimizer.defaults.get("fused"))

    def update(self, lr: Optional[float], skip: Optional[torch.Tensor] = None) -> None:
        """Apply the optimizer at ``lr`` (None: skip this step's update), then drop the gradients.

        ``skip``: a boolean on the device that drops the update there (``skips_on_device``).
        """
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if skip is not None:
                # read by fused AdamW's step (as GradScaler sets it): no attribute torch declares
                self.optimizer.found_inf = skip.float()  # type: ignore[attr-defined]
            self.backend.step_optimizer(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)

    def train_whole_model(self, micro_batches: list[Batch], num_targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of each micro-batch through the model; their cross-entropy shares, summed."""
        total_loss = torch.zeros((), device=self.backend.device)
        for mb in micro_batches:
            with self.autocast():
                loss, aux_loss = self._forward(mb, num_targets)
                objective = loss.loss
                if aux_loss is not None:
                    # A mean over this replica's tokens, unlike the loss (its share of a global sum):
                    # divided by the replicas that the gradient averaging below sums over, the
                    # replicas' aux losses enter as their mean.
                    objective = objective + aux_loss / (len(micro_batches) * self.backend.gradient_divisor)
            (objective * self.backend.gradient_divisor).backward()
            total_loss += loss.cross_entropy.detach()
        return total_loss

    def evaluate_whole_model(self, micro_batch: Batch) -> torch.Tensor:
        """``[cross-entropy sum, tokens]`` of one held-out micro-batch (per-token means, weighed by their count)."""
        with self.autocast():
            loss, _ = self._forward(micro_batch)
        return torch.stack([loss.cross_entropy.double() * loss.num_tokens, loss.num_tokens.double()])

    def _forward(
        self, micro_batch: Batch, num_targets: Optional[torch.Tensor] = None
    ) -> tuple[LossOutput, Optional[torch.Tensor]]:
        """The model's forward and loss of a micro-batch (``forward_with_loss``)."""
        return forward_with_loss(
            self.model,
            self.loss_fn,
            micro_batch["input_ids"],
            micro_batch["labels"],
            num_targets,
            micro_batch.get("positions"),
            micro_batch.get("segment_ids"),
        )

    def stage_loss(self, num_targets: Optional[torch.Tensor]) -> MicroBatchLoss:
        """The last pipeline stage's loss of a micro-batch, for a training step or (``num_targets`` None) evaluation."""

        def loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            out = self.loss_fn(LossInput(logits, labels, num_targets))
            if num_targets is None:  # evaluation: per-token means, weighed by their token counts
                return out.loss, out.cross_entropy * out.num_tokens, out.num_tokens
            return out.loss * self.backend.gradient_divisor, out.cross_entropy, out.num_tokens

        return loss
