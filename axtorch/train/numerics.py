"""What a non-finite loss or gradient norm does to the run: drop the update, or stop."""

from __future__ import annotations

import enum
import math


class NonFinitePolicy(enum.Enum):
    #: Drop the step's update (the batch is consumed), up to ``trainer.max_nonfinite_skips`` in a row.
    skip = "skip"
    #: Save the last good state and end the run with a non-zero exit.
    stop = "stop"


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient norm."""


class NonFiniteGuard:
    """Counts consecutive non-finite steps and decides, step by step, whether to apply the update."""

    def __init__(self, policy: NonFinitePolicy, max_consecutive_skips: int):
        self.policy = policy
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive = 0

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        """True to apply the update; False to skip it; raises ``NonFiniteError`` to stop."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.consecutive = 0
            return True
        self.consecutive += 1
        what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
        if self.policy is NonFinitePolicy.stop:
            raise NonFiniteError(f"{what}; stopping (trainer.nonfinite=stop)")
        if self.consecutive > self.max_consecutive_skips:
            raise NonFiniteError(
                f"{what}: {self.consecutive} non-finite steps in a row, more than "
                f"trainer.max_nonfinite_skips={self.max_consecutive_skips}; stopping"
            )
        return False
