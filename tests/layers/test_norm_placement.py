"""Norm placement (pre / post / sandwich) and residual dropout in the transformer layer."""

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.config.serialize import config_from_dict, config_to_dict
from axtorch.interop.families.llama import LLAMA
from axtorch.layers import (
    AttentionConfig,
    AttentionInput,
    CausalMaskConfig,
    FeedForwardInput,
    GatedFeedForwardConfig,
    LayerNormConfig,
    PostNormResidualConfig,
    PreNormResidualConfig,
    RotaryEmbeddingConfig,
    SandwichNormResidualConfig,
    TransformerLayerConfig,
    TransformerLayerInput,
)
from axtorch.layers.init import initialize_parameters
from axtorch.train.experiment import ExperimentConfig

PRE_NORM_NAMES = [
    "attention_norm.weight",
    "attention_norm.bias",
    "attention.q_proj.weight",
    "attention.k_proj.weight",
    "attention.v_proj.weight",
    "attention.o_proj.weight",
    "feed_forward_norm.weight",
    "feed_forward_norm.bias",
    "feed_forward.gate_proj.weight",
    "feed_forward.up_proj.weight",
    "feed_forward.down_proj.weight",
]


def _layer(residual, dim=16):
    config = TransformerLayerConfig(
        attention=AttentionConfig(
            num_heads=4, num_kv_heads=2, position=RotaryEmbeddingConfig(), mask=CausalMaskConfig()
        ),
        feed_forward=GatedFeedForwardConfig(hidden_dim=32),
        norm=LayerNormConfig(),
        residual=residual,
    )
    torch.manual_seed(0)
    layer = config.build(dim).double()
    initialize_parameters(layer)
    with torch.no_grad():  # norms that are not the identity at initialisation, each different
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    return layer


def _positions(batch, seq):
    return torch.arange(seq).expand(batch, -1)


def _sublayers(layer, positions):
    attention = lambda x: layer.attention(AttentionInput(x, positions)).hidden_states  # noqa: E731
    feed_forward = lambda x: layer.feed_forward(FeedForwardInput(x)).hidden_states  # noqa: E731
    return attention, feed_forward


def _run(layer, x):
    return layer(TransformerLayerInput(x, _positions(*x.shape[:2]))).hidden_states


@pytest.mark.parametrize("residual", [None, PreNormResidualConfig()], ids=["default", "pre"])
def test_pre_norm_matches_the_hand_written_formula(residual):
    layer = _layer(residual)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    attention, feed_forward = _sublayers(layer, _positions(2, 5))
    h = x + attention(layer.attention_norm(x))
    expected = h + feed_forward(layer.feed_forward_norm(h))
    with torch.no_grad():
        torch.testing.assert_close(_run(layer, x), expected)


def test_post_norm_matches_the_hand_written_formula():
    layer = _layer(PostNormResidualConfig())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    attention, feed_forward = _sublayers(layer, _positions(2, 5))
    h = layer.attention_norm(x + attention(x))
    expected = layer.feed_forward_norm(h + feed_forward(h))
    with torch.no_grad():
        torch.testing.assert_close(_run(layer, x), expected)


def test_sandwich_norm_matches_the_hand_written_formula():
    layer = _layer(SandwichNormResidualConfig())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    attention, feed_forward = _sublayers(layer, _positions(2, 5))
    attention_post_norm = layer.attention_residual.post_norm
    feed_forward_post_norm = layer.feed_forward_residual.post_norm
    h = x + attention_post_norm(attention(layer.attention_norm(x)))
    expected = h + feed_forward_post_norm(feed_forward(layer.feed_forward_norm(h)))
    with torch.no_grad():
        torch.testing.assert_close(_run(layer, x), expected)


def test_parameter_names_do_not_depend_on_the_placement_except_for_the_sandwichs_own_norms():
    names = {
        placement: [name for name, _ in _layer(residual).named_parameters()]
        for placement, residual in [
            ("default", None),
            ("pre", PreNormResidualConfig()),
            ("post", PostNormResidualConfig()),
            ("sandwich", SandwichNormResidualConfig()),
        ]
    }
    assert names["default"] == names["pre"] == names["post"] == PRE_NORM_NAMES
    assert sorted(names["sandwich"]) == sorted(
        [
            *PRE_NORM_NAMES,
            "attention_residual.post_norm.weight",
            "attention_residual.post_norm.bias",
            "feed_forward_residual.post_norm.weight",
            "feed_forward_residual.post_norm.bias",
        ]
    )


@pytest.mark.parametrize(
    "residual", [PreNormResidualConfig, PostNormResidualConfig, SandwichNormResidualConfig], ids=lambda c: c.__name__
)
def test_residual_dropout_acts_on_the_sublayer_output_in_training_only(residual):
    layer = _layer(residual(dropout=0.5))
    reference = _layer(residual())
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(_run(layer.eval(), x), _run(reference.eval(), x))
        layer.train()
        assert not torch.allclose(_run(layer, x), _run(reference.train(), x))
        assert not torch.allclose(_run(layer, x), _run(layer, x))  # a fresh mask each step


def test_residual_dropout_leaves_the_residual_stream_itself_alone():
    layer = _layer(PreNormResidualConfig(dropout=0.9)).train()
    with torch.no_grad():  # zero both sublayer outputs: only the stream remains, and it is not dropped
        layer.attention.o_proj.weight.zero_()
        layer.feed_forward.down_proj.weight.zero_()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(_run(layer, x), x)


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich"])
def test_placements_compose_from_hydra_and_round_trip_through_yaml(placement):
    config = load_experiment_config([f"model/norm_placement={placement}", "model.decoder.layer.residual.dropout=0.1"])
    residual = config.model.decoder.layer.residual
    assert residual.dropout == 0.1
    assert config_from_dict(config_to_dict(config), ExperimentConfig).model.decoder.layer.residual == residual


def test_residual_dropout_out_of_range_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError) as info:
        load_experiment_config(["model.decoder.layer.residual.dropout=1.0"])
    assert info.value.key == "model.decoder.layer.residual.dropout"


@pytest.mark.parametrize(
    "overrides",
    [
        ["model/norm_placement=post"],
        ["model/norm_placement=sandwich"],
        ["model.decoder.layer.residual.dropout=0.1"],
        ["model/attention_kernel=softcapped"],
    ],
    ids=lambda o: o[0],
)
def test_hf_llama_export_refuses_what_llama_cannot_express(overrides):
    LLAMA.config_to_hf(load_experiment_config([]).model)  # the default, pre-norm, exports
    with pytest.raises(ValueError, match="LlamaForCausalLM cannot express this model"):
        LLAMA.config_to_hf(load_experiment_config(overrides).model)
