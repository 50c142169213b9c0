"""ALiBi: the paper's slopes, the bias it adds to the scores, KV-cache decoding, and tensor parallelism."""

import math

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.layers import AlibiConfig, AttentionConfig, AttentionInput, CausalMaskConfig, KVCache
from axtorch.layers.attention_kernel import SdpaKernelConfig, SoftcappedKernelConfig
from axtorch.layers.init import initialize_parameters
from axtorch.layers.relative_position import alibi_slopes


def _attention(num_heads=4, num_kv_heads=None, dim=32, cap=None):
    config = AttentionConfig(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        position=AlibiConfig(),
        mask=CausalMaskConfig(),
        kernel=SdpaKernelConfig() if cap is None else SoftcappedKernelConfig(cap=cap),
    )
    torch.manual_seed(0)
    module = config.build(dim)
    initialize_parameters(module)
    return module.double()


def _positions(batch, seq, start=0):
    return torch.arange(start, start + seq).expand(batch, -1)


def test_slopes_for_a_power_of_two_are_the_papers_geometric_sequence():
    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    expected = torch.tensor([2.0 ** (-i / 2) for i in range(1, 17)])  # float32, like the slopes
    torch.testing.assert_close(alibi_slopes(16), expected)


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 6, 12, 20, 40, 64])
def test_slopes_match_hf_bloom_for_any_head_count(num_heads):
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    # Bloom's bias for a key at position 1 is its slope times 1.
    expected = bloom.build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)[:, 0, 1]
    assert torch.equal(alibi_slopes(num_heads), expected)


def test_slopes_for_other_head_counts_interleave_the_next_power_of_two():
    # 6 heads: the 4 slopes for 4 heads, then slopes 1 and 3 of the sequence for 8 heads.
    expected = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    assert alibi_slopes(6).tolist() == expected


def _reference(attention, x, positions, cap=None):
    """Hand-written multi-head attention with ALiBi: softmax(q.k / sqrt(d) - m_h (i - j)) v, causal."""
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
    q = attention.q_proj(x).view(batch, seq, heads, head_dim).transpose(1, 2)
    k = attention.k_proj(x).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    v = attention.v_proj(x).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)], dtype=x.dtype)  # power of two
    distance = (positions[:, :, None] - positions[:, None, :]).to(x.dtype)  # [B, Sq, Sk]
    scores = scores - slopes[:, None, None] * distance[:, None]
    scores = scores.masked_fill(distance[:, None] < 0, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return attention.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


@pytest.mark.parametrize("cap", [None, 2.0], ids=["sdpa", "soft_capped"])
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_attention_adds_the_linear_bias_to_the_scores(cap, num_kv_heads):
    attention = _attention(num_heads=4, num_kv_heads=num_kv_heads, cap=cap)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    positions = _positions(2, 7)
    with torch.no_grad():
        out = attention(AttentionInput(x, positions)).hidden_states
        torch.testing.assert_close(out, _reference(attention, x, positions, cap))


def test_bias_depends_on_relative_position_only():
    bias = AlibiConfig().build(8).score_bias(_positions(1, 3, start=100), _positions(1, 5, start=98), num_heads=4)
    assert bias.shape == (1, 4, 3, 5) and bias.dtype == torch.float32
    torch.testing.assert_close(bias, AlibiConfig().build(8).score_bias(_positions(1, 3, 2), _positions(1, 5), 4))
    # A query at position 100 against the key at 98: two positions back.
    torch.testing.assert_close(bias[0, :, 0, 0], -2 * alibi_slopes(4))


def test_kv_cache_decoding_equals_the_full_forward():
    attention = _attention(num_heads=4, num_kv_heads=2).eval()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        full = attention(AttentionInput(x, _positions(2, 9))).hidden_states
        cache = KVCache.allocate(2, 2, 16, attention.head_dim, dtype=torch.float64, device=torch.device("cpu"))
        steps = [attention(AttentionInput(x[:, :4], _positions(2, 4), cache)).hidden_states]  # prompt
        for position in range(4, 9):
            step = AttentionInput(x[:, position : position + 1], _positions(2, 1, start=position), cache)
            steps.append(attention(step).hidden_states)
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_attention_on_a_subset_of_heads_fails_loudly():
    """What native tensor parallelism would do: projections that yield 2 of the 4 heads."""
    attention = _attention(num_heads=4)
    head_dim = attention.head_dim
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attention, name, attention.config.qkv_projection.build(32, 2 * head_dim).double())
        attention.o_proj = attention.config.output_projection.build(2 * head_dim, 32).double()
        with pytest.raises(ValueError, match="biases 4 heads but this attention holds 2"):
            attention(AttentionInput(torch.randn(1, 3, 32, dtype=torch.float64), _positions(1, 3)))


def test_validation_refuses_native_tensor_parallelism_and_names_the_key():
    with pytest.raises(ConfigError, match="AlibiConfig") as info:
        load_experiment_config(["model/position=alibi", "backend=native", "mesh.model=2"])
    assert info.value.key == "mesh.model" and info.value.value == 2
    config = load_experiment_config(["model/position=alibi"])
    assert type(config.model.decoder.layer.attention.position) is AlibiConfig
