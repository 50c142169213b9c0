"""FLOPs-per-token formula (PaLM appendix B), measured matmul peak, and MFU arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from axtorch.train.flops import measure_matmul_peak_flops, mfu, transformer_flops_per_token


def test_flops_per_token_matches_hand_computation() -> None:
    # 2 layers, dim 64, seq 128, vocab 1000; 100_000 params besides the embedding table.
    attention = 12 * 2 * 64 * 128  # 196_608
    tied = transformer_flops_per_token(100_000, num_layers=2, dim=64, seq_len=128, vocab_size=1000, tied=True)
    assert tied == 6 * (100_000 + 64_000) + attention == 1_180_608
    # An untied head is already part of the non-embedding count.
    untied = transformer_flops_per_token(164_000, num_layers=2, dim=64, seq_len=128, vocab_size=1000, tied=False)
    assert untied == tied


def test_flops_per_token_rejects_non_positive_sizes() -> None:
    with pytest.raises(ValueError, match="seq_len must be positive, got 0"):
        transformer_flops_per_token(1000, num_layers=2, dim=64, seq_len=0, vocab_size=1000, tied=True)


def test_measured_peak_is_positive_and_finite() -> None:
    peak = measure_matmul_peak_flops(torch.device("cpu"), size=256, seconds=0.1)
    assert peak > 0 and math.isfinite(peak)


def test_measuring_an_unsupported_device_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="pass the chip's datasheet peak"):
        measure_matmul_peak_flops(torch.device("meta"), size=256, seconds=0.1)


def test_mfu_arithmetic() -> None:
    assert mfu(tokens_per_s=1000.0, flops_per_token=6e9, peak_flops=1.2e13) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="peak_flops must be positive"):
        mfu(1000.0, 6e9, 0.0)
