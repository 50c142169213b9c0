"""FLOPs-per-token formula (PaLM appendix B), measured matmul peak, and MFU arithmetic."""

from __future__ import annotations

import time
import types

import pytest
import torch

from axtorch.layers import (
    AttentionConfig,
    CausalMaskConfig,
    DecoderConfig,
    GatedFeedForwardConfig,
    MixtureOfExpertsConfig,
    RMSNormConfig,
    RotaryEmbeddingConfig,
    RouterConfig,
    TransformerLayerConfig,
)
from axtorch.models.causal_lm import CausalLMConfig
from axtorch.train.flops import (
    active_non_embedding_parameters,
    active_parameters,
    measure_matmul_peak_flops,
    mfu,
    transformer_flops_per_token,
)


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


def test_measured_peak_agrees_with_an_independent_timing_and_physics() -> None:
    a = torch.randn(768, 768)

    def timed() -> float:
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < 0.2:
            torch.matmul(a, a)
            calls += 1
        return calls * 2 * 768**3 / elapsed

    # One thread each, taking turns, the best of several: under a parallel test run another worker
    # shares the cores, and a multi-threaded matmul whose threads wait on a busy core measures its
    # neighbour, not this machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pairs = [(timed(), measure_matmul_peak_flops(torch.device("cpu"), size=512, seconds=0.2)) for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    achieved, peak = max(p[0] for p in pairs), max(p[1] for p in pairs)
    # The same machine runs both, so they agree within a generous factor.
    assert achieved / 4 < peak < achieved * 4
    # No core does more than 64 fp32 FLOPs a cycle (two AVX-512 FMA units), nor runs above 6 GHz.
    assert peak < 64 * 6e9


def test_a_cpu_peak_is_the_cores_own_while_other_processes_hold_them(monkeypatch) -> None:
    """Simulated: the wall clock runs three times as fast as the process's CPU time over its
    threads, as when other processes hold the cores two thirds of the time. The peak is then
    what the CPU time says, not a third of it."""
    import axtorch.train.flops as flops

    real = time.perf_counter
    threads = torch.get_num_threads()
    contended = types.SimpleNamespace(perf_counter=lambda: 3 * real(), process_time=lambda: threads * real())
    alone = types.SimpleNamespace(perf_counter=real, process_time=lambda: threads * real())
    peaks = {}
    for name, clock in (("contended", contended), ("alone", alone), ("contended again", contended)):
        monkeypatch.setattr(flops, "time", clock)
        peaks[name] = measure_matmul_peak_flops(torch.device("cpu"), size=256, seconds=0.1)
    # Wall-clock timing alone would make the contended peak a third of the other; machine noise
    # between the measurements stays well within a factor of two.
    assert peaks["alone"] / 2 < max(peaks["contended"], peaks["contended again"]) < peaks["alone"] * 2


@pytest.mark.parametrize(("seconds_each", "sides"), [(1e-4, [256, 512, 1024, 2048]), (0.05, [256])])
def test_the_peak_matmul_grows_only_until_one_takes_long_enough(monkeypatch, seconds_each, sides) -> None:
    """A dtype the CPU has no units for (bf16: one 2048 matmul took 126 s here) stops at a size
    that runs in milliseconds; a fast one grows to the largest size."""
    import axtorch.train.flops as flops

    seen = []

    def timed(a, b, out, iterations):
        seen.append(a.shape[0])
        return seconds_each

    monkeypatch.setattr(flops, "_seconds_per_matmul", timed)
    peak = measure_matmul_peak_flops(torch.device("cpu"), torch.bfloat16, seconds=0.01)
    assert sorted(set(seen)) == sides
    assert peak == pytest.approx(2 * sides[-1] ** 3 / seconds_each)


def test_measuring_the_peak_leaves_the_global_random_state_alone() -> None:
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    measure_matmul_peak_flops(torch.device("cpu"), size=64, seconds=0.01)
    assert torch.equal(torch.rand(3), expected)


def test_measuring_an_unsupported_device_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="pass the chip's datasheet peak"):
        measure_matmul_peak_flops(torch.device("meta"), size=256, seconds=0.1)


def test_mfu_arithmetic() -> None:
    assert mfu(tokens_per_s=1000.0, flops_per_token=6e9, peak_flops=1.2e13) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="peak_flops must be positive"):
        mfu(1000.0, 6e9, 0.0)


def test_a_mixture_of_experts_counts_only_the_experts_each_token_uses() -> None:
    moe = MixtureOfExpertsConfig(hidden_dim=96, num_experts=8, router=RouterConfig(top_k=2))
    attention = AttentionConfig(num_heads=4, position=RotaryEmbeddingConfig(), mask=CausalMaskConfig())
    config = CausalLMConfig(
        vocab_size=100,
        dim=32,
        decoder=DecoderConfig(
            num_layers=2, layer=TransformerLayerConfig(attention=attention, feed_forward=moe, norm=RMSNormConfig())
        ),
    )
    with torch.device("meta"):
        model = config.build()
    total = sum(p.numel() for p in model.parameters())
    unused_experts = 2 * 6 * 3 * 96 * 32  # per layer, 6 of the 8 experts' three [96, 32] matrices
    assert active_parameters(model) == total - unused_experts
    assert active_non_embedding_parameters(model) == total - unused_experts - 100 * 32
    # A dense model's parameters are all active.
    config.decoder.layer.feed_forward = GatedFeedForwardConfig(hidden_dim=96)
    with torch.device("meta"):
        dense = config.build()
    assert active_parameters(dense) == sum(p.numel() for p in dense.parameters())
