"""Autoregressive generation with a preallocated KV cache: one forward per new token."""

from __future__ import annotations

from typing import Optional

import torch

from axtorch.infer.sampling import SamplingConfig, sample_next_token
from axtorch.models.causal_lm import CausalLM, CausalLMInput


@torch.no_grad()
def generate(
    model: CausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    *,
    eos_id: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> list[int]:
    """Continue ``prompt_ids``; stops after ``max_new_tokens`` or at ``eos_id`` (not returned)."""
    if not prompt_ids:
        raise ValueError("the prompt must contain at least one token")
    total = len(prompt_ids) + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"model.max_seq_len={model.config.max_seq_len}"
        )
    parameter = next(model.parameters())
    was_training = model.training
    model.eval()
    caches = model.allocate_kv_caches(1, total, dtype=parameter.dtype, device=parameter.device)
    ids = torch.tensor([prompt_ids], device=parameter.device)
    logits = model(CausalLMInput(input_ids=ids, kv_caches=caches)).logits[:, -1]
    generated: list[int] = []
    for position in range(len(prompt_ids), total):
        token = sample_next_token(logits, sampling, generator)
        if eos_id is not None and int(token) == eos_id:
            break
        generated.append(int(token))
        if position + 1 == total:
            break
        step = CausalLMInput(
            input_ids=token[:, None], positions=torch.full((1, 1), position, device=ids.device), kv_caches=caches
        )
        logits = model(step).logits[:, -1]
    model.train(was_training)
    return generated
