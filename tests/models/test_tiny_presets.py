"""Each model family has a ``*_tiny`` debug variant: the family's features at a size that trains on a CPU."""

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.compose.golden import group_options
from axtorch.models.causal_lm import CausalLMInput
from axtorch.train.trainer import build_model

#: family -> its tiny variant
TINY_VARIANTS = {
    "llama3": "llama_tiny",
    "mistral": "mistral_tiny",
    "mixtral": "mixtral_tiny",
    "qwen3": "qwen3_tiny",
    "qwen3_moe": "qwen3_moe_tiny",
    "gpt2": "gpt2_tiny",
    "gemma3": "gemma3_tiny",
    # No HF family: the smallest heterogeneous stack (sliding-window and global layers alternating).
    "local_global": "local_global_tiny",
}


def test_every_tiny_preset_is_listed_under_its_family():
    assert sorted(TINY_VARIANTS.values()) == [o for o in group_options("model") if o.endswith("_tiny")]


@pytest.mark.parametrize("preset", sorted(TINY_VARIANTS.values()))
def test_tiny_preset_is_small_and_fits_a_fixed_batch(preset):
    config = load_experiment_config([f"model={preset}"])
    model = build_model(config, torch.device("cpu"))
    assert sum(p.numel() for p in model.parameters()) < 10_000_000
    ids = torch.randint(0, config.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        output = model(CausalLMInput(ids[:, :-1]))
        loss = torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), ids[:, 1:].flatten())
        if output.aux_loss is not None:
            loss = loss + output.aux_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
