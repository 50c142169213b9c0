"""AdamW's state made before its first step, as that step would make it, without running it.

The XLA backend shards the moments like their parameters before its first step is traced (so
that they are not replicated), and the dry run traces a steady-state step, which needs the state
to exist; both make it here, and a test holds it to what torch's own first step makes.
"""

from __future__ import annotations

import torch
from torch import nn


def create_adamw_state(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """Give every trainable parameter without state what ``torch.optim.AdamW``'s first step gives
    it (``_init_group``): a step count, and moments shaped, typed and laid out like the parameter
    (a DTensor's moments are DTensors of its placements); returns the parameters given state."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(f"only Adam and AdamW's state can be made ahead, not {type(optimizer).__name__}'s")
    created = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not param.requires_grad or param in optimizer.state:
                continue
            state = optimizer.state[param]
            if group["capturable"] or group["fused"]:  # the step count lives on the device, in float32
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            created.append(param)
    return created


def _scalar_dtype() -> torch.dtype:
    """The step count's dtype: float64 under a float64 default, else float32 (as torch's optimizers)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
