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

from axtorch.layers.eager_parts import eager_parts
from axtorch.layers.transformer import TransformerLayer
from axtorch.parallel.backend_kind import BackendKind
from axtorch.train.experiment import ExperimentConfig


@dataclass(frozen=True)
class CompileChoice:
    """Whether the trainer compiles its layers (and the fused head's chunks), and the line that says why."""

    enabled: bool
    reason: str
    #: The fused head's per-chunk softmax and gradient compile too: on CUDA, where that elementwise
    #: work over [chunk, vocab] is several passes over memory per matmul. On the CPU the matmuls
    #: dominate and the compiled chunk is no faster (docs/training.md, "Compiled steps").
    head: bool = False


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
    on = device.type == "cuda" if asked is None else asked
    if asked is None:
        where = "on CUDA" if on else f"off on {device.type} (trainer.compile=true turns it on)"
        reason = f"{'on' if on else 'off'}: trainer.compile=null is {where}"
    else:
        reason = f"{'on' if on else 'off'}: trainer.compile={str(on).lower()}"
    head = on and device.type == "cuda"
    if on:
        reason += "; the fused head's chunks " + ("compile too" if head else f"run eagerly on {device.type}")
    return CompileChoice(on, reason, head)


def compile_layers(model: nn.Module) -> list[str]:
    """Compile each decoder layer of ``model`` in place; return a line for each part that stays eager."""
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            module.compile()
    return [f"{reason} ({count} layer(s))" for reason, count in eager_parts(model).items()]


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
