"""The Llama 3 presets have the published shapes: their parameter counts match Meta's figures."""

import pytest
import torch

from axtorch.config.compose import load_train_config

#: Parameter counts Meta publishes for each model (model cards / HF safetensors totals).
PUBLISHED_PARAMETERS = {
    "llama3_1b": 1.24e9,
    "llama3_3b": 3.21e9,
    "llama3_8b": 8.03e9,
    "llama3_70b": 70.6e9,
    "llama3_405b": 405.9e9,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMETERS))
def test_preset_parameter_count_matches_the_published_figure(preset):
    config = load_train_config([f"model={preset}"])
    with torch.device("meta"):  # shapes only: no memory, seconds even for 405B
        model = config.model.build()
    count = sum(p.numel() for p in model.parameters())
    assert count == pytest.approx(PUBLISHED_PARAMETERS[preset], rel=0.01)
    assert config.model.vocab_size == 128256
