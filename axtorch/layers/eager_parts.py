"""Parts of a layer that run eagerly inside a compiled layer, declared by the layer itself.

A layer whose forward cannot compile as a whole (shapes the data decides, read on the host) wraps
that part in ``torch.compiler.disable`` and says so in a class attribute, ``EAGER_UNDER_COMPILE``:
a function of the module that returns why it runs eagerly, or None where this configuration
compiles whole. ``trainer.compile`` prints each reason once, so a partly eager step is never
silently slower (``axtorch/train/compile.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Optional

from torch import nn

#: A layer's declaration: the module (of the declaring class) -> why part of it runs eagerly under
#: torch.compile, or None.
EagerReason = Callable[[Any], Optional[str]]


def eager_parts(model: nn.Module) -> dict[str, int]:
    """Each reason a part of ``model`` runs eagerly under torch.compile, with how many modules give it."""
    reasons: Counter[str] = Counter()
    for module in model.modules():
        for cls in type(module).__mro__:
            declared: Optional[EagerReason] = vars(cls).get("EAGER_UNDER_COMPILE")
            if declared is not None:
                reason = declared(module)
                if reason is not None:
                    reasons[reason] += 1
                break
    return dict(reasons)
