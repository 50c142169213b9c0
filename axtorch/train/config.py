"""The trainer's own settings: steps, batch, evaluation, checkpoints, precision, logging."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from axtorch.config.errors import ConfigError
from axtorch.train.numerics import NonFinitePolicy
from axtorch.train.watchdog import WatchdogAction


class SaveErrorPolicy(enum.Enum):
    #: End the run (non-zero exit), saving nothing more: the last good checkpoint is the one to resume.
    stop = "stop"
    #: Warn loudly and keep training; the next checkpoint tries again.
    warn = "warn"


class Precision(enum.Enum):
    fp32 = "fp32"
    #: bf16 autocast for matmuls; parameters, optimizer state and the loss stay in fp32.
    bf16 = "bf16"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self is Precision.bf16 else torch.float32


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
    #: With ``precision=bf16`` on the native backend, FSDP gathers parameters in bf16 (half the
    #: bytes; the sharded fp32 parameters stay the optimizer's) and reduces gradients in this
    #: dtype: fp32 (the default) or bf16, which halves the reduce-scatter's bytes at some precision.
    reduce_precision: Precision = Precision.fp32
    #: torch.compile each decoder layer (``axtorch/train/compile.py``); null: on with CUDA devices
    #: only. Not with ``backend=xla``, which compiles its whole step itself.
    compile: Optional[bool] = None
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 20
    checkpoint_every: int = 500
    #: How many of the newest checkpoints are kept.
    keep_checkpoints: int = 3
    #: Also keep, for good, every checkpoint whose step is a multiple of this (None: none).
    keep_every: Optional[int] = None
    #: Write checkpoints in a background thread; training pays only for the copy to host memory.
    async_checkpoint: bool = True
    #: What a failed save (a full disk, a permission error) does to the run.
    on_save_error: SaveErrorPolicy = SaveErrorPolicy.stop
    #: What a non-finite loss or gradient norm does: drop that update, or save and stop.
    nonfinite: NonFinitePolicy = NonFinitePolicy.skip
    #: With ``nonfinite=skip``, more non-finite steps than this in a row stop the run.
    max_nonfinite_skips: int = 5
    #: Seconds without a completed step before the hang watchdog acts (None: no watchdog).
    watchdog_seconds: Optional[float] = 1800.0
    watchdog_action: WatchdogAction = WatchdogAction.exit
    #: Peak FLOP/s per device for MFU; None: measured on a CPU, the datasheet figure of a known chip.
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
        if self.watchdog_seconds is not None and self.watchdog_seconds <= 0:
            raise ConfigError(f"{key}.watchdog_seconds", self.watchdog_seconds, "a positive number of seconds or null")
        if self.reduce_precision is Precision.bf16 and self.precision is not Precision.bf16:
            raise ConfigError(
                f"{key}.reduce_precision",
                "bf16",
                f"fp32 unless {key}.precision=bf16",
                reason="fp32 runs reduce in fp32",
            )
        if self.max_nonfinite_skips < 0:
            raise ConfigError(f"{key}.max_nonfinite_skips", self.max_nonfinite_skips, "an integer >= 0")
        if self.keep_every is not None and self.keep_every <= 0:
            raise ConfigError(f"{key}.keep_every", self.keep_every, "a positive integer or null")
        if self.batch_size % self.grad_accum_steps:
            divisors = [d for d in range(1, self.batch_size + 1) if self.batch_size % d == 0]
            raise ConfigError(
                f"{key}.grad_accum_steps",
                self.grad_accum_steps,
                f"a divisor of trainer.batch_size={self.batch_size}: {divisors}",
                reason=f"batch {self.batch_size} cannot be split into {self.grad_accum_steps} equal micro-batches",
            )
