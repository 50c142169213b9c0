"""How a backend runs the model, apart from how it splits it (``mesh``, ``sharding``).

These are execution choices: they change speed, memory or compile time, never the math, so they
live in the experiment (``execution.*``), not in the model's layer configs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LayerRunnerKind(enum.Enum):
    """What fills the decoder's ``layer_runner`` seam (``axtorch.layers.transformer.LayerRunner``)."""

    #: One layer after another, each its own code (every backend; the default).
    unrolled = "unrolled"
    #: One compiled loop over the layers' stacked weights (torch_xla's ``scan``), so that compile
    #: time does not grow with depth. ``backend=xla`` only.
    scan = "scan"


@dataclass
class ExecutionConfig:
    layer_runner: LayerRunnerKind = LayerRunnerKind.unrolled
