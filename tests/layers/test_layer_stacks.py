"""Heterogeneous decoder stacks: named layer variants merged over ``decoder.layer``, repeated by a pattern."""

import dataclasses

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.config.serialize import config_from_yaml, config_to_yaml
from axtorch.layers.attention_mask import CausalMaskConfig, SlidingWindowMaskConfig
from axtorch.layers.relative_position import RotaryEmbeddingConfig
from axtorch.layers.transformer import DecoderConfig, DecoderInput, TransformerLayerInput
from axtorch.models.causal_lm import CausalLMInput
from axtorch.plan.memory import activation_bytes
from axtorch.train.checkpoint import read_model_tensors
from axtorch.train.config import Precision
from axtorch.train.flops import model_flops_per_token
from axtorch.train.trainer import Trainer, build_model

#: The preset with a window short enough for a 12-token sequence to cross it.
STACK = ["model=local_global_tiny", "model.decoder.variants.local.attention.mask.window=4"]


def test_the_preset_resolves_to_local_and_global_layers_with_their_own_rope_bases():
    decoder = load_experiment_config(STACK).model.decoder
    layers = decoder.layer_configs()
    assert decoder.period() == 3 and len(layers) == decoder.num_layers == 6
    assert [layer.attention.mask for layer in layers] == [SlidingWindowMaskConfig(window=4)] * 2 + [
        CausalMaskConfig()
    ] + [SlidingWindowMaskConfig(window=4)] * 2 + [CausalMaskConfig()]
    assert [layer.attention.position.theta for layer in layers] == [1e4, 1e4, 1e6] * 2
    assert all(layer.feed_forward == decoder.layer.feed_forward for layer in layers)


#: The same stack at the debug experiment's size, for training runs.
SMALL_STACK = [
    *STACK,
    "model.vocab_size=512",
    "model.dim=64",
    "model.decoder.num_layers=4",
    "model.decoder.layer.attention.num_heads=4",
    "model.decoder.layer.feed_forward.hidden_dim=128",
]


def test_a_stack_equals_its_layers_built_by_hand_and_run_one_by_one():
    config = load_experiment_config(STACK)
    torch.manual_seed(0)
    model = build_model(config, torch.device("cpu"))
    base = config.model.decoder.layer
    local = dataclasses.replace(
        base,
        attention=dataclasses.replace(base.attention, mask=SlidingWindowMaskConfig(window=4)),
    )
    global_ = dataclasses.replace(
        base, attention=dataclasses.replace(base.attention, position=RotaryEmbeddingConfig(theta=1e6))
    )
    reference = [(local if i % 3 < 2 else global_).build(config.model.dim) for i in range(6)]
    for layer, built in zip(reference, model.decoder.layers):
        layer.load_state_dict(built.state_dict())

    hidden = torch.randn(2, 12, config.model.dim, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12)
    expected = hidden
    for layer in reference:
        expected = layer(TransformerLayerInput(expected, positions)).hidden_states
    got = model.decoder(DecoderInput(hidden, positions)).hidden_states
    torch.testing.assert_close(got, model.decoder.final_norm(expected), atol=1e-6, rtol=1e-5)

    uniform = load_experiment_config([*STACK, "model.decoder.pattern=[global]", "~model.decoder.variants.local"])
    assert not torch.allclose(
        build_model(uniform, torch.device("cpu")).decoder(DecoderInput(hidden, positions)).hidden_states, got
    )


def test_pattern_and_variant_fields_compose_from_the_command_line():
    decoder = load_experiment_config(
        [
            "model=llama_tiny",
            "model.decoder.num_layers=5",
            "model.decoder.pattern=[local,local,global]",
            "+model/mask@model.decoder.variants.local.attention.mask=sliding_window",
            "+model.decoder.variants.local.attention.mask.window=512",
            "+model.decoder.variants.global.attention.position.theta=1000000",
        ]
    ).model.decoder
    assert [layer.attention.mask for layer in decoder.layer_configs()] == [
        SlidingWindowMaskConfig(window=512),
        SlidingWindowMaskConfig(window=512),
        CausalMaskConfig(),
        SlidingWindowMaskConfig(window=512),
        SlidingWindowMaskConfig(window=512),
    ]
    assert [layer.attention.position.theta for layer in decoder.layer_configs()] == [1e4, 1e4, 1e6, 1e4, 1e4]


@pytest.mark.parametrize(
    ("override", "key", "value", "allowed"),
    [
        ("model.decoder.pattern=[local,globl]", "model.decoder.pattern[1]", "globl", "['global', 'local']"),
        (
            "+model.decoder.variants.global.attention.position.thta=5",
            "model.decoder.variants.global.attention.position.thta",
            None,
            "['theta']",
        ),
        ("model.decoder.pattern=[local]", "model.decoder.variants.global", None, "['local']"),
    ],
)
def test_a_bad_variant_name_or_field_is_a_config_error_naming_key_value_and_allowed(override, key, value, allowed):
    with pytest.raises(ConfigError) as raised:
        load_experiment_config(["model=local_global_tiny", override])
    assert raised.value.key == key
    assert value is None or raised.value.value == value
    assert allowed in raised.value.allowed


def test_a_stack_round_trips_through_yaml_and_a_uniform_decoder_writes_no_stack_fields():
    decoder = load_experiment_config(STACK).model.decoder
    assert config_from_yaml(config_to_yaml(decoder), DecoderConfig) == decoder
    uniform = load_experiment_config(["model=llama_tiny"]).model.decoder
    text = config_to_yaml(uniform)
    assert "variants" not in text and "pattern" not in text  # its config text and digest are unchanged


def test_kv_cache_decoding_of_a_stack_equals_the_full_forward():
    config = load_experiment_config(STACK)
    torch.manual_seed(0)
    model = build_model(config, torch.device("cpu"))
    tokens = torch.randint(0, config.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(CausalLMInput(tokens)).logits
        caches = model.allocate_kv_caches(2, 12, dtype=torch.float32, device=torch.device("cpu"), max_write=6)
        assert [cache.window for cache in caches] == [4, 4, None] * 2  # a ring for each local layer
        steps = [model(CausalLMInput(tokens[:, :6], kv_caches=caches)).logits]
        for position in range(6, 12):
            steps.append(
                model(
                    CausalLMInput(
                        tokens[:, position : position + 1], positions=torch.full((2, 1), position), kv_caches=caches
                    )
                ).logits
            )
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_a_stack_checkpoint_keeps_layer_names_and_resumes_bit_identically(tmp_path, data_cache):
    def trainer(run_dir):
        overrides = [*SMALL_STACK, "trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.eval_every=100"]
        return Trainer(
            load_experiment_config(
                [
                    "experiment=debug",
                    f"run_dir={run_dir}",
                    f"data.cache_dir={data_cache}",
                    "trainer.progress_bar=false",
                    "trainer.plot=false",
                    *overrides,
                ]
            )
        )

    trainer(tmp_path / "straight").fit()
    assert trainer(tmp_path / "resumed").fit(until_step=2).step == 2
    assert trainer(tmp_path / "resumed").fit().step == 4
    expected = read_model_tensors(tmp_path / "straight" / "checkpoints" / "step_00000004")
    got = read_model_tensors(tmp_path / "resumed" / "checkpoints" / "step_00000004")
    assert {name.split(".")[2] for name in got if name.startswith("decoder.layers.")} == {str(i) for i in range(4)}
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def _model(*overrides):
    return load_experiment_config([*STACK, *overrides]).model


def test_flops_of_a_stack_are_the_sum_of_its_layers_flops_and_a_window_scores_fewer_keys():
    only = {"local": "~model.decoder.variants.global", "global": "~model.decoder.variants.local"}

    def flops(variant, layers, seq_len):
        config = _model(f"model.decoder.pattern=[{variant}]", only[variant], f"model.decoder.num_layers={layers}")
        return model_flops_per_token(config, seq_len)

    for seq_len, local_is_cheaper in ((64, True), (4, False)):  # beyond and within the window of 4
        outside = 2 * flops("local", 1, seq_len) - flops("local", 2, seq_len)  # embedding, head, final norm
        local, global_ = flops("local", 1, seq_len) - outside, flops("global", 1, seq_len) - outside
        assert (local < global_) == local_is_cheaper
        stack = model_flops_per_token(_model(), seq_len)  # local, local, global, twice
        assert stack == pytest.approx(outside + 4 * local + 2 * global_, rel=1e-12)


def test_planner_activation_memory_of_a_stack_sums_each_layers_kept_activations():
    """Selective remat keeps the names each layer declares: a stack whose variants differ keeps each one's."""
    precision = Precision.fp32
    overrides = ["model/remat=selective", "+model.decoder.variants.global.feed_forward.hidden_dim=1024"]
    stack = activation_bytes(_model(*overrides), 2, 64, 1, precision)
    wide = activation_bytes(_model(*overrides, "model.decoder.layer.feed_forward.hidden_dim=1024"), 2, 64, 1, precision)
    narrow_model = _model(overrides[0])
    narrow = activation_bytes(narrow_model, 2, 64, 1, precision)
    assert narrow < stack < wide
    # While a wide layer is recomputed its whole set is live (in the stack too): the rest is kept
    # per layer, and 2 of the 6 layers are wide.
    layer = narrow_model.decoder.layer
    dim = narrow_model.dim
    widened = dataclasses.replace(layer, feed_forward=dataclasses.replace(layer.feed_forward, hidden_dim=1024))
    recomputed = 4 * 2 * 64 * (widened.saved_width(dim) - layer.saved_width(dim))
    assert stack - narrow - recomputed == pytest.approx((wide - narrow - recomputed) / 3, rel=1e-9)


def test_remat_applies_to_every_layer_of_a_stack_and_keeps_its_gradients():
    tokens = torch.randint(0, 4096, (2, 12), generator=torch.Generator().manual_seed(3))
    gradients = {}
    for remat in ("none", "full"):
        config = load_experiment_config([*STACK, f"model/remat={remat}"])
        torch.manual_seed(0)
        model = build_model(config, torch.device("cpu"))
        calls = []
        if model.decoder.remat is not None:
            model.decoder.remat.register_forward_pre_hook(lambda module, args, calls=calls: calls.append(args[0]))
        model(CausalLMInput(tokens)).logits.square().mean().backward()
        assert calls == ([] if remat == "none" else list(model.decoder.layers))
        gradients[remat] = {name: p.grad for name, p in model.named_parameters()}
    for name, grad in gradients["none"].items():
        torch.testing.assert_close(gradients["full"][name], grad, atol=1e-7, rtol=1e-5)
