"""Attention logit soft-capping (Gemma 2) and the configurable softmax scale."""

import math

import pytest
import torch
import torch.nn.functional as F

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.layers import AttentionConfig, AttentionInput, CausalMaskConfig, KVCache, RotaryEmbeddingConfig
from axtorch.layers.attention_kernel import SoftcappedKernel, SoftcappedKernelConfig
from axtorch.layers.attention_mask import SlidingWindowMaskConfig
from axtorch.layers.init import initialize_parameters


def _attention(num_heads=4, num_kv_heads=2, dim=32, mask=None, **fields):
    config = AttentionConfig(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        position=RotaryEmbeddingConfig(),
        mask=mask or CausalMaskConfig(),
        **fields,
    )
    torch.manual_seed(0)
    module = config.build(dim)
    initialize_parameters(module)
    return module


def _positions(batch, seq, start=0):
    return torch.arange(start, start + seq).expand(batch, -1)


def _projected(attention, x, positions):
    """q [B, H, S, D] and k, v repeated to H heads, as attention computes them."""
    batch, seq, _ = x.shape
    q = attention.q_proj(x).view(batch, seq, -1, attention.head_dim).transpose(1, 2)
    k = attention.k_proj(x).view(batch, seq, -1, attention.head_dim).transpose(1, 2)
    v = attention.v_proj(x).view(batch, seq, -1, attention.head_dim).transpose(1, 2)
    q, k = attention.position(q, k, positions)
    return q, k, v


def _reference(attention, x, positions, *, cap, scale):
    """Hand-written causal attention: softmax(cap * tanh(scale * q.k / cap)) v."""
    q, k, v = _projected(attention, x, positions)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
    out = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
    return attention.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


@pytest.mark.parametrize("softmax_scale", [None, 0.05])
def test_soft_capped_attention_matches_a_hand_reference(softmax_scale):
    attention = _attention(kernel=SoftcappedKernelConfig(cap=3.0), softmax_scale=softmax_scale).double()
    with torch.no_grad():
        attention.q_proj.weight.mul_(20.0)  # scores well beyond the cap, so that it matters
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    scale = softmax_scale or 1 / math.sqrt(attention.head_dim)
    with torch.no_grad():
        out = attention(AttentionInput(x, _positions(2, 6))).hidden_states
        torch.testing.assert_close(out, _reference(attention, x, _positions(2, 6), cap=3.0, scale=scale))
        uncapped = _reference(attention, x, _positions(2, 6), cap=None, scale=scale)
    assert not torch.allclose(out, uncapped)


def test_softmax_scale_without_a_cap_stays_on_sdpa_and_matches_the_reference():
    attention = _attention(softmax_scale=0.05).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    with torch.no_grad():
        out = attention(AttentionInput(x, _positions(2, 6))).hidden_states
        torch.testing.assert_close(out, _reference(attention, x, _positions(2, 6), cap=None, scale=0.05))


def test_the_cap_bounds_the_logits_of_huge_dot_products():
    cap = 2.0
    q = torch.full((1, 1, 4, 8), 1e4, dtype=torch.float64)
    k = torch.linspace(-1e4, 1e4, 32, dtype=torch.float64).view(1, 1, 4, 8)
    v = torch.eye(4, 8, dtype=torch.float64).view(1, 1, 4, 8)  # each key's value is one-hot: out = weights
    allowed = torch.ones(4, 4, dtype=torch.bool)
    weights = SoftcappedKernel(cap)(q, k, v, mask=allowed, causal=False, scale=1.0, dropout_p=0.0)[0, 0, :, :4]
    assert torch.isfinite(weights).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(4, dtype=torch.float64))
    # Every logit lies in (-cap, cap): no weight exceeds another by more than exp(2 cap).
    assert (weights.max(-1).values / weights.min(-1).values).max() <= math.exp(2 * cap)
    uncapped = torch.softmax(q @ k.transpose(-1, -2), dim=-1)[0, 0]
    assert uncapped.min() == 0.0  # without the cap the same scores saturate the softmax


def test_soft_capped_attention_takes_an_additive_float_mask_like_sdpa():
    q, k, v = (torch.randn(2, 4, 5, 8, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(2, 4, 5, 5, dtype=torch.float64).masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
    huge_cap = 1e9  # tanh is the identity at this scale: the result is plain attention
    out = SoftcappedKernel(huge_cap)(q, k, v, mask=bias, causal=False, scale=0.3, dropout_p=0.0)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3))


def _attention_before_soft_capping(attention, x, positions):
    """The attention forward as it was before soft-capping existed (SDPA, no scale argument)."""
    q, k, v = _projected(attention, x, positions)
    if attention.mask.is_plain_causal:
        mask, is_causal = None, True
    else:
        mask, is_causal = attention.mask(positions, positions), False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    return attention.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


@pytest.mark.parametrize("mask", [CausalMaskConfig(), SlidingWindowMaskConfig(window=3)], ids=["causal", "window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_a_cap_outputs_are_bit_identical_to_before(mask, dtype):
    attention = _attention(mask=mask).to(dtype)
    assert type(attention.kernel).__name__ == "SdpaKernel" and attention.config.softmax_scale is None
    x = torch.randn(2, 6, 32, dtype=dtype)
    with torch.no_grad():
        out = attention(AttentionInput(x, _positions(2, 6))).hidden_states
        assert torch.equal(out, _attention_before_soft_capping(attention, x, _positions(2, 6)))


def test_soft_capped_kv_cache_decoding_equals_the_full_forward():
    attention = _attention(kernel=SoftcappedKernelConfig(cap=1.5)).double().eval()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        full = attention(AttentionInput(x, _positions(2, 7))).hidden_states
        cache = KVCache.allocate(2, 2, 12, attention.head_dim, dtype=torch.float64, device=torch.device("cpu"))
        steps = [attention(AttentionInput(x[:, :3], _positions(2, 3), cache)).hidden_states]
        for position in range(3, 7):
            step = AttentionInput(x[:, position : position + 1], _positions(2, 1, start=position), cache)
            steps.append(attention(step).hidden_states)
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_attention_dropout_applies_on_the_soft_capped_path_in_training_only():
    attention = _attention(kernel=SoftcappedKernelConfig(cap=3.0), dropout=0.5)
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        evaluation = [attention.eval()(AttentionInput(x, _positions(1, 6))).hidden_states for _ in range(2)]
        training = [attention.train()(AttentionInput(x, _positions(1, 6))).hidden_states for _ in range(2)]
    assert torch.equal(*evaluation)
    assert not torch.allclose(*training)


@pytest.mark.parametrize("override", ["kernel.cap=0", "kernel.cap=-30.0", "softmax_scale=0", "softmax_scale=-0.1"])
def test_non_positive_cap_or_scale_is_a_config_error_naming_the_key(override):
    with pytest.raises(ConfigError) as info:
        load_experiment_config(["model/attention_kernel=softcapped", f"model.decoder.layer.attention.{override}"])
    assert info.value.key == f"model.decoder.layer.attention.{override.split('=')[0]}"
    assert "positive" in info.value.allowed


def test_the_kernel_is_chosen_from_the_command_line():
    config = load_experiment_config(
        ["model/attention_kernel=softcapped", "model.decoder.layer.attention.kernel.cap=30"]
    )
    attention = config.model.build().decoder.layers[0].attention
    assert isinstance(attention.kernel, SoftcappedKernel) and attention.kernel.cap == 30.0
    with pytest.raises(ConfigError, match="sdpa"):
        load_experiment_config(["model/attention_kernel=flash9"])
