"""``trainer.compile``: torch.compile over each decoder layer, and a count of what it compiles.

A layer at a time, as torchtitan compiles per transformer block: compiling the whole step would
trace every layer, so its compile time would grow with depth. Layers of one config share their
compiled code (dynamo keys it on the layer's code and guards on its config): Llama's identical
layers compile once, a stack with several layer configs (Gemma 3's sliding and global layers)
once per config. Each layer stays the module it was (``nn.Module.compile``): its parameter names,
FSDP's hooks (which dynamo leaves to run eagerly around the compiled body), remat around it and a
checkpoint's contents are unchanged.

Compiles are counted (``CompileWatch``): one after the first steps (a shape or a guard that
changed) costs seconds to minutes of every step it happens in, so the trainer says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch._dynamo.callback import CallbackArgs, callback_handler

from axtorch.layers.transformer import TransformerLayer
from axtorch.parallel.backend_kind import BackendKind
from axtorch.train.experiment import ExperimentConfig


@dataclass(frozen=True)
class CompileChoice:
    """Whether the trainer compiles its layers, and the one line that says why."""

    enabled: bool
    reason: str


def compile_choice(config: ExperimentConfig, device: torch.device) -> CompileChoice:
    """``trainer.compile`` resolved for ``device``: None compiles on CUDA only.

    On this project's CPU hosts a compiled step is 2-10% faster but costs about 11 s of compiling
    and a C++ compiler, which nets a few seconds at most over a run of minutes (docs/training.md,
    "Compiled steps", has the figures); on a GPU it is the difference between eager's launch-bound
    step and the benchmark's. ``ExperimentConfig.validate`` has already
    refused an explicit ``true`` where it cannot apply.
    """
    asked = config.trainer.compile
    if config.backend is BackendKind.xla:
        return CompileChoice(False, "off: backend=xla compiles the whole step itself")
    if asked is None:
        on = device.type == "cuda"
        where = "on CUDA" if on else f"off on {device.type} (trainer.compile=true turns it on)"
        return CompileChoice(on, f"{'on' if on else 'off'}: trainer.compile=null is {where}")
    return CompileChoice(asked, f"{'on' if asked else 'off'}: trainer.compile={str(asked).lower()}")


def compile_layers(model: nn.Module) -> None:
    """Compile each decoder layer of ``model`` in place."""
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            module.compile()


@dataclass
class CompileWatch:
    """Counts torch.compile's compiles (a layer's graph, its backward) and their seconds, while entered."""

    graphs: int = 0
    seconds: float = 0.0
    _started: Optional[float] = field(default=None, repr=False)

    def _start(self, args: CallbackArgs) -> None:
        self._started = time.perf_counter()

    def _end(self, args: CallbackArgs) -> None:
        if self._started is not None:
            self.graphs += 1
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def __enter__(self) -> CompileWatch:
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        callback_handler.remove_start_callback(self._start)
        callback_handler.remove_end_callback(self._end)
