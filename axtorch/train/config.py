"""The trainer's own settings: steps, batch, evaluation, checkpoints, precision, logging."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from axtorch.config.errors import ConfigError


class Precision(enum.Enum):
    fp32 = "fp32"
    #: bf16 autocast for matmuls; parameters, optimizer state and the loss stay in fp32.
    bf16 = "bf16"


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    #: Global batch in sequences per optimizer step (across all micro-batches and devices).
    batch_size: int = 16
    grad_accum_steps: int = 1
    seed: int = 0
    #: "auto" (CUDA if available, else CPU), "cpu", "cuda", "cuda:1", ...
    device: str = "auto"
    precision: Precision = Precision.fp32
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 20
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    async_checkpoint: bool = False
    #: Peak FLOP/s for MFU; None measures the fp32 (or bf16) GEMM peak of this machine at start.
    peak_flops: Optional[float] = None
    tensorboard: bool = True
    progress_bar: bool = True
    plot: bool = True

    def validate(self, key: str = "trainer") -> None:
        for name in (
            "max_steps",
            "batch_size",
            "grad_accum_steps",
            "log_every",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
            "keep_checkpoints",
        ):
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(f"{key}.{name}", value, "a positive integer")
        if self.batch_size % self.grad_accum_steps:
            divisors = [d for d in range(1, self.batch_size + 1) if self.batch_size % d == 0]
            raise ConfigError(
                f"{key}.grad_accum_steps",
                self.grad_accum_steps,
                f"a divisor of trainer.batch_size={self.batch_size}: {divisors}",
                reason=f"batch {self.batch_size} cannot be split into {self.grad_accum_steps} equal micro-batches",
            )
