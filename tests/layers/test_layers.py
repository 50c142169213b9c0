"""Behaviour of each layer on its own: shapes, dtypes, masking, GQA, position encodings, norms."""

import pytest
import torch
import torch.nn.functional as F

from axtorch.layers import (
    Activation,
    AttentionConfig,
    AttentionInput,
    CausalMaskConfig,
    EmbeddingConfig,
    FeedForwardInput,
    GatedFeedForwardConfig,
    InitConfig,
    InitScheme,
    LayerNormConfig,
    LinearConfig,
    MLPFeedForwardConfig,
    NoPositionConfig,
    RMSNormConfig,
    RotaryEmbeddingConfig,
    TransformerLayerConfig,
    TransformerLayerInput,
)
from axtorch.layers.attention_mask import SlidingWindowMaskConfig
from axtorch.layers.init import initialize_parameters
from axtorch.layers.relative_position import (
    LinearScaledRotaryEmbeddingConfig,
    Llama3RotaryEmbeddingConfig,
    YarnRotaryEmbeddingConfig,
)


def _attention(num_heads=4, num_kv_heads=None, dim=32, position=None, mask=None, qk_norm=None):
    config = AttentionConfig(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        query_norm=qk_norm,
        key_norm=qk_norm,
        position=position or RotaryEmbeddingConfig(),
        mask=mask or CausalMaskConfig(),
    )
    torch.manual_seed(0)
    module = config.build(dim)
    initialize_parameters(module)
    return module


def _positions(batch, seq):
    return torch.arange(seq).expand(batch, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_attention_shapes_and_dtypes(dtype):
    attention = _attention(num_heads=4, num_kv_heads=2).to(dtype)
    x = torch.randn(2, 5, 32, dtype=dtype)
    out = attention(AttentionInput(x, _positions(2, 5)))
    assert out.hidden_states.shape == (2, 5, 32)
    assert out.hidden_states.dtype == dtype


def test_attention_is_causal():
    attention = _attention()
    x = torch.randn(1, 8, 32)
    base = attention(AttentionInput(x, _positions(1, 8))).hidden_states
    changed = x.clone()
    changed[:, 5:] = torch.randn(1, 3, 32)
    out = attention(AttentionInput(changed, _positions(1, 8))).hidden_states
    torch.testing.assert_close(out[:, :5], base[:, :5])
    assert not torch.allclose(out[:, 5:], base[:, 5:])


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = _attention(num_heads=8, num_kv_heads=2).double()
    mha = _attention(num_heads=8, num_kv_heads=8).double()
    head_dim, groups = 4, 4
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        for name in ("k_proj", "v_proj"):
            kv = getattr(gqa, name).weight.view(2, head_dim, 32)
            getattr(mha, name).weight.copy_(kv.repeat_interleave(groups, dim=0).reshape(32, 32))
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    torch.testing.assert_close(
        gqa(AttentionInput(x, _positions(2, 6))).hidden_states,
        mha(AttentionInput(x, _positions(2, 6))).hidden_states,
    )


def test_multi_query_attention_has_one_kv_head():
    mqa = _attention(num_heads=4, num_kv_heads=1)
    assert mqa.k_proj.weight.shape == (8, 32) and mqa.v_proj.weight.shape == (8, 32)


@pytest.mark.parametrize(
    "config",
    [
        RotaryEmbeddingConfig(theta=100.0),
        Llama3RotaryEmbeddingConfig(theta=100.0, factor=8.0, original_max_position_embeddings=32),
        LinearScaledRotaryEmbeddingConfig(theta=100.0, factor=4.0),
        YarnRotaryEmbeddingConfig(theta=100.0, factor=4.0, original_max_position_embeddings=32),
    ],
    ids=lambda config: type(config).__name__,
)
def test_rotary_embedding_makes_scores_depend_on_relative_position_only(config):
    rope = config.build(8)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def score(query_pos, key_pos):
        rq, _ = rope(q, q, torch.tensor([[query_pos]]))
        _, rk = rope(k, k, torch.tensor([[key_pos]]))
        return (rq * rk).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100), rtol=1e-5, atol=1e-5)  # fp32 angles
    assert not torch.allclose(score(7, 3), score(7, 5))


def test_rotary_embedding_preserves_norm_and_is_identity_at_zero():
    rope = RotaryEmbeddingConfig().build(16)
    q = torch.randn(2, 3, 4, 16)
    rotated, _ = rope(q, q, torch.zeros(2, 4, dtype=torch.long))
    torch.testing.assert_close(rotated, q)
    rotated, _ = rope(q, q, _positions(2, 4) * 37)
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))


def test_sliding_window_mask_sees_the_last_window_positions():
    mask = SlidingWindowMaskConfig(window=3).build()
    allowed = mask(_positions(1, 6), _positions(1, 6))[0, 0]
    for query in range(6):
        assert allowed[query].nonzero().flatten().tolist() == list(range(max(0, query - 2), query + 1))
    with pytest.raises(ValueError, match="window=0"):
        SlidingWindowMaskConfig(window=0).build()


def test_sliding_window_attention_ignores_tokens_beyond_the_window():
    attention = _attention(mask=SlidingWindowMaskConfig(window=3))
    x = torch.randn(1, 8, 32)
    base = attention(AttentionInput(x, _positions(1, 8))).hidden_states
    changed = x.clone()
    changed[:, 2] = torch.randn(32)
    out = attention(AttentionInput(changed, _positions(1, 8))).hidden_states
    torch.testing.assert_close(out[:, :2], base[:, :2])  # before the token
    assert not torch.allclose(out[:, 2:5], base[:, 2:5])  # positions 2, 3, 4 see position 2
    torch.testing.assert_close(out[:, 5:], base[:, 5:])  # position 2 is out of their window


def _outputs_before_and_after_scaling_queries_and_keys(attention, x):
    with torch.no_grad():
        before = attention(AttentionInput(x, _positions(2, 5))).hidden_states
        attention.q_proj.weight.mul_(7.0)
        attention.k_proj.weight.mul_(0.2)
        return before, attention(AttentionInput(x, _positions(2, 5))).hidden_states


def test_qk_norm_adds_per_head_norms_that_make_attention_invariant_to_the_scale_of_q_and_k():
    plain = _attention(num_kv_heads=2).double()
    normed = _attention(num_kv_heads=2, qk_norm=RMSNormConfig(eps=1e-12)).double()
    assert plain.query_norm is None
    shapes = {name: tuple(p.shape) for name, p in normed.named_parameters() if "norm" in name}
    assert shapes == {"query_norm.weight": (8,), "key_norm.weight": (8,)}  # one gain per head feature
    with torch.no_grad():
        normed.query_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 32, dtype=torch.float64)

    before, after = _outputs_before_and_after_scaling_queries_and_keys(normed, x)
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-10)
    before, after = _outputs_before_and_after_scaling_queries_and_keys(plain, x)
    assert not torch.allclose(after, before)


def test_no_position_attention_is_permutation_equivariant_over_the_past():
    attention = _attention(position=NoPositionConfig())
    x = torch.randn(1, 4, 32)
    swapped = x[:, [1, 0, 2, 3]]
    last = attention(AttentionInput(x, _positions(1, 4))).hidden_states[:, -1]
    last_swapped = attention(AttentionInput(swapped, _positions(1, 4))).hidden_states[:, -1]
    torch.testing.assert_close(last, last_swapped)


def test_rmsnorm_matches_formula_and_keeps_dtype():
    norm = RMSNormConfig(eps=1e-6).build(8)
    norm.reset_parameters()
    x = torch.randn(3, 8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), expected)
    assert norm(x.bfloat16()).dtype == torch.bfloat16


def test_layernorm_matches_torch():
    norm = LayerNormConfig().build(8)
    norm.reset_parameters()
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), F.layer_norm(x, (8,)))
    assert LayerNormConfig(bias=False).build(8).bias is None


def test_swiglu_and_gelu_feed_forward():
    swiglu = GatedFeedForwardConfig(hidden_dim=16, activation=Activation.silu).build(8)
    gelu = MLPFeedForwardConfig(hidden_dim=16).build(8)
    for module in (swiglu, gelu):
        initialize_parameters(module)
    x = torch.randn(2, 3, 8)
    expected = swiglu.down_proj(F.silu(swiglu.gate_proj(x)) * swiglu.up_proj(x))
    torch.testing.assert_close(swiglu(FeedForwardInput(x)).hidden_states, expected)
    torch.testing.assert_close(gelu(FeedForwardInput(x)).hidden_states, gelu.down_proj(F.gelu(gelu.up_proj(x))))
    assert swiglu(FeedForwardInput(x)).aux_loss is None


def test_linear_and_embedding_init_follow_their_config():
    torch.manual_seed(0)
    linear = LinearConfig(bias=True, init=InitConfig(scheme=InitScheme.normal, std=0.5)).build(256, 256)
    linear.reset_parameters()
    assert abs(linear.weight.std().item() - 0.5) < 0.02 and torch.all(linear.bias == 0)
    truncated = LinearConfig(init=InitConfig(scheme=InitScheme.truncated_normal, std=0.1)).build(64, 64)
    truncated.reset_parameters()
    assert truncated.weight.abs().max() <= 0.2
    embedding = EmbeddingConfig(init=InitConfig(std=1.0)).build(10, 4)
    embedding.reset_parameters()
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(embedding(ids), embedding.weight[ids])


def test_transformer_layer_is_pre_norm_residual():
    """``h = x + attn(norm1(x)); out = h + ffn(norm2(h))``, with norms whose gains are not 1, so
    post-norm (``norm(x + f(x))``) and sandwich (``x + norm(f(norm(x)))``) would both differ."""
    config = TransformerLayerConfig(
        attention=AttentionConfig(num_heads=4, position=RotaryEmbeddingConfig(), mask=CausalMaskConfig()),
        feed_forward=GatedFeedForwardConfig(hidden_dim=64),
        norm=RMSNormConfig(),
    )
    layer = config.build(32)
    initialize_parameters(layer)
    with torch.no_grad():
        for norm in (layer.attention_norm, layer.feed_forward_norm):
            norm.weight.uniform_(0.5, 2.0)
    x = torch.randn(2, 5, 32)
    positions = _positions(2, 5)
    with torch.no_grad():
        h = x + layer.attention(AttentionInput(layer.attention_norm(x), positions)).hidden_states
        expected = h + layer.feed_forward(FeedForwardInput(layer.feed_forward_norm(h))).hidden_states
        out = layer(TransformerLayerInput(x, positions))
    torch.testing.assert_close(out.hidden_states, expected)
    assert not torch.allclose(out.hidden_states, x, atol=1e-3)  # both branches contribute
