"""Next-token cross-entropy with an ignore index and optional z-loss, from logits or fused with the head."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.models.causal_lm import CausalLMInput
from axtorch.train.head_cross_entropy import head_cross_entropy

IGNORE_INDEX = -100


@dataclass
class CrossEntropyLossConfig:
    ignore_index: int = IGNORE_INDEX
    #: Weight of the z-loss ``mean(logsumexp(logits)^2)`` (PaLM uses 1e-4); 0 disables it.
    z_loss_weight: float = 0.0
    #: Tokens per chunk of the fused output head and cross-entropy, so that the whole
    #: [tokens, vocab] logits never exist (see ``head_cross_entropy``); null computes whole logits.
    chunk_size: Optional[int] = 256

    def validate(self, key: str = "loss") -> None:
        if self.z_loss_weight < 0:
            raise ConfigError(f"{key}.z_loss_weight", self.z_loss_weight, "a non-negative float")
        if self.chunk_size is not None and self.chunk_size <= 0:
            raise ConfigError(f"{key}.chunk_size", self.chunk_size, "a positive number of tokens, or null")

    def build(self, compiled_head: bool = False) -> CrossEntropyLoss:
        """``compiled_head``: the fused head's chunks run through torch.compile (``trainer.compile`` on CUDA)."""
        return CrossEntropyLoss(self, compiled_head)


#: ``(final hidden states [B, S, D], head weight [V, D], head bias [V] or None) -> (loss, cross_entropy, z_loss)``.
HeadLossFn = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], tuple[torch.Tensor, ...]]


@dataclass
class LossInput:
    logits: Optional[torch.Tensor]  # [B, S, V]; None when ``fused`` holds the losses
    labels: torch.Tensor  # [B, S], IGNORE_INDEX where no loss is taken
    #: Divide summed losses by this many tokens instead of the tokens in this batch. Gradient
    #: accumulation and data parallelism pass the global count so that every token weighs the same.
    num_target_tokens: Optional[torch.Tensor] = None
    #: ``(loss, cross_entropy, z_loss)`` already taken with the head by the function that
    #: ``CrossEntropyLoss.head_fn`` gave the model.
    fused: Optional[tuple[torch.Tensor, ...]] = None


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to differentiate: cross-entropy + z-loss, per target token
    cross_entropy: torch.Tensor  # scalar, per target token
    z_loss: torch.Tensor  # scalar, per target token (zero when disabled)
    num_tokens: torch.Tensor  # target tokens in this batch


class CrossEntropyLoss(nn.Module):
    """Token-averaged cross-entropy computed in float32, whatever the logits' dtype."""

    def __init__(self, config: CrossEntropyLossConfig, compiled_head: bool = False):
        super().__init__()
        self.config = config
        self.compiled_head = compiled_head

    def head_fn(self, labels: torch.Tensor, num_target_tokens: Optional[torch.Tensor] = None) -> Optional[HeadLossFn]:
        """The loss for the model to take with its output head (``CausalLMInput.head_fn``); None without chunking.

        It must run inside the model's forward: only there are the head's parameters whole
        under FSDP.
        """
        if self.config.chunk_size is None:
            return None
        normalizer = num_target_tokens if num_target_tokens is not None else (labels != self.config.ignore_index).sum()
        return functools.partial(
            self._fused,
            labels=labels,
            normalizer=normalizer.clamp(min=1),
        )

    def _fused(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        *,
        labels: torch.Tensor,
        normalizer: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        assert self.config.chunk_size is not None
        return head_cross_entropy(
            hidden_states,
            weight,
            bias,
            labels,
            ignore_index=self.config.ignore_index,
            z_loss_weight=self.config.z_loss_weight,
            normalizer=normalizer,
            chunk_size=self.config.chunk_size,
            compiled=self.compiled_head,
        )

    def forward(self, inputs: LossInput) -> LossOutput:
        labels = inputs.labels.flatten()
        if inputs.fused is not None:
            loss, cross_entropy, z_loss = inputs.fused
            num_tokens = (labels != self.config.ignore_index).sum()
            return LossOutput(loss=loss, cross_entropy=cross_entropy, z_loss=z_loss, num_tokens=num_tokens)
        if inputs.logits is None:
            raise ValueError("LossInput needs logits, or the fused losses that the model took with head_fn")
        logits = inputs.logits.flatten(0, -2)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        valid = labels != self.config.ignore_index
        num_tokens = valid.sum()
        normalizer = (inputs.num_target_tokens if inputs.num_target_tokens is not None else num_tokens).clamp(min=1)
        cross_entropy = F.cross_entropy(logits, labels, ignore_index=self.config.ignore_index, reduction="sum")
        cross_entropy = cross_entropy / normalizer
        if self.config.z_loss_weight > 0:
            log_z = torch.logsumexp(logits, dim=-1)
            z_loss = self.config.z_loss_weight * (log_z.pow(2) * valid).sum() / normalizer
        else:
            z_loss = torch.zeros((), dtype=logits.dtype, device=logits.device)
        return LossOutput(
            loss=cross_entropy + z_loss, cross_entropy=cross_entropy, z_loss=z_loss, num_tokens=num_tokens
        )


def forward_with_loss(
    model: nn.Module,
    loss_fn: CrossEntropyLoss,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    num_target_tokens: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
    segment_ids: Optional[torch.Tensor] = None,
) -> tuple[LossOutput, Optional[torch.Tensor]]:
    """A causal LM's forward and its loss: ``(loss, the model's aux loss)``.

    With ``loss.chunk_size`` set the head runs fused with the loss inside the model's forward;
    otherwise the model returns whole logits and the loss reads them. ``positions`` (None:
    0..S-1) are the tokens' absolute positions, given when they are a slice of longer sequences
    or restart in each packed document; ``segment_ids`` (None: one document a row) the documents.
    """
    head_fn = loss_fn.head_fn(labels, num_target_tokens)
    output = model(CausalLMInput(input_ids, positions=positions, segment_ids=segment_ids, head_fn=head_fn))
    loss = loss_fn(LossInput(output.logits, labels, num_target_tokens, fused=output.head_output))
    return loss, output.aux_loss
