"""RoPE frequency schedules: Llama 3.1 remapping, linear position interpolation, YaRN.

Each schedule's defining property, alone. That scores still depend on relative positions only is
in test_layers.py; HF float64 parity of whole models is in tests/models/test_hf_llama_parity.py
and tests/interop/test_hf_roundtrip.py.
"""

import math

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.layers.relative_position import (
    LinearScaledRotaryEmbeddingConfig,
    Llama3RotaryEmbeddingConfig,
    RotaryEmbeddingConfig,
    YarnRotaryEmbeddingConfig,
)

CPU = torch.device("cpu")
HEAD_DIM = 64
LLAMA3 = Llama3RotaryEmbeddingConfig(theta=10000.0, factor=8.0, original_max_position_embeddings=64)
LINEAR = LinearScaledRotaryEmbeddingConfig(theta=10000.0, factor=4.0)
YARN = YarnRotaryEmbeddingConfig(theta=10000.0, factor=4.0, original_max_position_embeddings=2048)


def _rotate(config, q, k, positions):
    return config.build(q.shape[-1])(q, k, positions)


def test_llama3_keeps_fast_pairs_slows_slow_ones_and_blends_between():
    config = LLAMA3
    plain = RotaryEmbeddingConfig(theta=config.theta).inverse_frequencies(HEAD_DIM, CPU)
    scaled = config.inverse_frequencies(HEAD_DIM, CPU)
    wavelength = 2 * math.pi / plain
    fast = wavelength < config.original_max_position_embeddings / config.high_freq_factor
    slow = wavelength > config.original_max_position_embeddings / config.low_freq_factor
    between = ~fast & ~slow
    assert fast.any() and slow.any() and between.any()
    assert torch.equal(scaled[fast], plain[fast])
    torch.testing.assert_close(scaled[slow], plain[slow] / config.factor)
    assert ((scaled[between] < plain[between]) & (scaled[between] > plain[between] / config.factor)).all()
    assert (scaled.diff() < 0).all()  # still a strictly decreasing schedule


def test_linear_scaling_divides_positions_by_the_factor():
    config = LINEAR
    q, k = torch.randn(2, 2, 6, HEAD_DIM, dtype=torch.float64), torch.randn(2, 1, 6, HEAD_DIM, dtype=torch.float64)
    positions = torch.arange(6).expand(2, -1)
    scaled = _rotate(config, q, k, positions * 4)
    plain = _rotate(RotaryEmbeddingConfig(theta=config.theta), q, k, positions)
    for ours, expected in zip(scaled, plain):
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_scales_attention():
    config = YARN
    plain = RotaryEmbeddingConfig(theta=config.theta).inverse_frequencies(HEAD_DIM, CPU)
    scaled = config.inverse_frequencies(HEAD_DIM, CPU)
    # Pairs that turn more than beta_fast times over the original context are kept, fewer than
    # beta_slow times interpolated.
    turns = config.original_max_position_embeddings * plain / (2 * math.pi)
    fast, slow = turns > config.beta_fast, turns < config.beta_slow
    assert fast.any() and slow.any()
    torch.testing.assert_close(scaled[fast], plain[fast])
    torch.testing.assert_close(scaled[slow], plain[slow] / config.factor)

    mscale = 0.1 * math.log(config.factor) + 1
    assert config.attention_scaling() == pytest.approx(mscale)
    q = torch.randn(1, 2, 5, HEAD_DIM, dtype=torch.float64)
    rotated, _ = _rotate(config, q, q, torch.arange(5)[None])
    torch.testing.assert_close(rotated.norm(dim=-1), mscale * q.norm(dim=-1))
    assert YarnRotaryEmbeddingConfig(factor=4.0, attention_factor=1.5).attention_scaling() == 1.5
    assert YarnRotaryEmbeddingConfig(factor=1.0).attention_scaling() == 1.0


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("rope_llama3", Llama3RotaryEmbeddingConfig),
        ("rope_linear", LinearScaledRotaryEmbeddingConfig),
        ("rope_yarn", YarnRotaryEmbeddingConfig),
    ],
)
def test_each_schedule_is_one_config_choice(option, expected):
    config = load_experiment_config(["model=llama_debug", f"model/position={option}"])
    position = config.model.decoder.layer.attention.position
    assert type(position) is expected
    with torch.device("meta"):
        config.model.build()
