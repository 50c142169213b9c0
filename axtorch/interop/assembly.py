"""Building an imported model around its converted tensors, so that loading never holds the weights twice."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain

import torch

from axtorch.models.causal_lm import CausalLM, CausalLMConfig


def model_from_state_dict(config: CausalLMConfig, state: Mapping[str, torch.Tensor]) -> CausalLM:
    """Build ``config`` on the meta device and adopt ``state`` (axtorch names) as its parameters.

    ``assign=True`` makes the tensors the parameters, so weights are never held twice; a
    converter that reads and casts lazily frees each checkpoint-dtype tensor once its cast copy exists.
    """
    with torch.device("meta"):
        model = config.build()
    model.load_state_dict(state, strict=True, assign=True)
    unloaded = [name for name, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if unloaded:
        raise RuntimeError(f"no checkpoint tensor for {unloaded} (left on the meta device)")
    return model
