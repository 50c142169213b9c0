"""Sharding rules resolve to per-parameter partition specs, and every mistake is a ConfigError."""

import re

import pytest
import torch

from axtorch.compose.experiment_loader import compose_experiment_config, describe_auto_sharding, load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.parallel.mesh import MeshConfig
from axtorch.parallel.sharding import (
    ActivationRule,
    ParameterRule,
    ShardingConfig,
    resolve_activation_specs,
    resolve_parameter_specs,
    shard_shape,
)

MESH = MeshConfig(data=2, fsdp=4, model=2).resolve(16)
SHAPES = {
    "embedding.weight": (512, 64),
    "decoder.layers.0.attention.q_proj.weight": (64, 64),
    "decoder.layers.0.attention_norm.weight": (64,),
    "decoder.layers.1.attention.q_proj.weight": (64, 64),
    "decoder.layers.1.attention_norm.weight": (64,),
}
MATRICES = ParameterRule(pattern=r".*\.weight", spec=["fsdp", "model"])
VECTORS = ParameterRule(pattern=r".*norm\.weight", spec=[None])


def _sharding(*rules, **kwargs) -> ShardingConfig:
    return ShardingConfig(parameters=list(rules), **kwargs)


def _error(rules, shapes=SHAPES, mesh=MESH, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        resolve_parameter_specs(shapes, _sharding(*rules, **kwargs), mesh)
    return info.value


def test_first_matching_rule_wins_and_specs_are_axis_tuples():
    specs = resolve_parameter_specs(SHAPES, _sharding(VECTORS, MATRICES), MESH)
    assert specs["decoder.layers.1.attention_norm.weight"] == (None,)
    assert specs["embedding.weight"] == (("fsdp",), ("model",))


def test_comma_joined_axes_split_one_dimension_over_several():
    rule = ParameterRule(pattern=r"embedding\.weight", spec=["data, fsdp", None])
    specs = resolve_parameter_specs({"embedding.weight": (512, 64)}, _sharding(rule), MESH)
    assert specs["embedding.weight"] == (("data", "fsdp"), None)
    assert shard_shape((512, 64), specs["embedding.weight"], MESH) == (64, 64)


def test_shard_shape_divides_each_dimension_by_its_axes():
    assert shard_shape((64, 48), (("fsdp",), ("model",)), MESH) == (16, 24)
    assert shard_shape((7,), (None,), MESH) == (7,)
    with pytest.raises(ValueError, match="evenly"):
        shard_shape((6,), (("fsdp",),), MESH)


def test_rule_matching_no_parameter_is_an_error():
    error = _error([VECTORS, MATRICES, ParameterRule(pattern=r"lm_head\.weight", spec=[None, None])])
    assert error.key == "sharding.parameters[2].pattern"
    assert "matches no parameter" in str(error)


def test_rule_shadowed_by_an_earlier_one_is_an_error():
    error = _error([VECTORS, MATRICES, ParameterRule(pattern=r".*q_proj\.weight", spec=[None, None])])
    assert error.key == "sharding.parameters[2].pattern"
    assert "claimed by an earlier rule" in str(error)


def test_optional_rule_may_match_nothing():
    optional = ParameterRule(pattern=r".*_proj\.bias", spec=["model"], optional=True)
    assert len(resolve_parameter_specs(SHAPES, _sharding(optional, VECTORS, MATRICES), MESH)) == len(SHAPES)


def test_uncovered_parameter_is_named_unless_coverage_is_optional():
    error = _error([VECTORS])
    assert error.key == "sharding.parameters"
    assert "embedding.weight" in str(error)
    specs = resolve_parameter_specs(SHAPES, _sharding(VECTORS, require_full_coverage=False), MESH)
    assert specs["embedding.weight"] == (None, None)


def test_spec_length_must_equal_the_rank():
    error = _error([ParameterRule(pattern=".*", spec=["fsdp", None])])
    assert error.key == "sharding.parameters[0].spec"
    assert "rank 1" in str(error) and "attention_norm.weight" in str(error)


def test_unknown_axis_lists_the_mesh_axes():
    error = _error([VECTORS, ParameterRule(pattern=".*", spec=["tensor", None])])
    assert error.key == "sharding.parameters[1].spec"
    assert "'tensor'" in str(error)
    assert all(axis in error.allowed for axis in ("data", "fsdp", "seq", "expert", "model"))


def test_axis_may_split_only_one_dimension():
    error = _error([VECTORS, ParameterRule(pattern=".*", spec=["fsdp", "data,fsdp"])])
    assert "'fsdp'" in str(error) and "more than one dimension" in str(error)


def test_indivisible_dimension_names_parameter_dimension_and_axes():
    mesh = MeshConfig(fsdp=3, model=2).resolve(6)
    error = _error([VECTORS, ParameterRule(pattern=".*", spec=["model", "fsdp"])], mesh=mesh)
    message = str(error)
    assert "embedding.weight dim 1 has size 64" in message
    assert "not divisible by fsdp=3;" in message
    error = _error([VECTORS, ParameterRule(pattern=".*", spec=["fsdp,model", None])], mesh=mesh)
    assert "dim 0 has size 512, not divisible by fsdp=3 x model=2 = 6" in str(error)


def test_axes_of_size_one_split_nothing():
    mesh = MeshConfig().resolve(1)
    rule = ParameterRule(pattern=r"embedding\.weight", spec=["data,fsdp,seq,expert", "model"])
    specs = resolve_parameter_specs({"embedding.weight": (5, 3)}, _sharding(rule), mesh)
    assert shard_shape((5, 3), specs["embedding.weight"], mesh) == (5, 3)


def test_bad_regex_is_a_config_error():
    error = _error([ParameterRule(pattern="decoder.(", spec=[None])])
    assert error.key == "sharding.parameters[0].pattern"


MODULES = ["", "embedding", "decoder", "decoder.layers", "decoder.layers.0", "decoder.layers.1", "decoder.final_norm"]


def test_activation_rules_map_module_io_and_field_to_a_spec():
    rules = ShardingConfig(
        activations=[
            ActivationRule(module=r"decoder\.layers\.0", field="hidden_states", io="input", spec=[None, None, None]),
            ActivationRule(
                module=r"decoder\.layers\.\d+", field="hidden_states", io="input", spec=["data,fsdp", None, None]
            ),
        ]
    )
    specs = resolve_activation_specs(MODULES, rules, MESH)
    assert specs == {
        ("decoder.layers.0", "input", "hidden_states"): (None, None, None),
        ("decoder.layers.1", "input", "hidden_states"): (("data", "fsdp"), None, None),
    }


@pytest.mark.parametrize(
    "rule, key",
    [
        (ActivationRule(module=r"decoder\.block\.\d+", field="hidden_states", spec=[None]), "module"),
        (ActivationRule(module=r"decoder", field="hidden_states", io="inputs", spec=[None]), "io"),
        (ActivationRule(module=r"decoder", field="hidden_states", spec=["tensor"]), "spec"),
    ],
)
def test_bad_activation_rule_is_a_config_error(rule, key):
    with pytest.raises(ConfigError) as info:
        resolve_activation_specs(MODULES, ShardingConfig(activations=[rule]), MESH)
    assert info.value.key == f"sharding.activations[0].{key}"


MODEL_VARIANTS = {
    "swiglu_rmsnorm_tied": ["model=llama_tiny"],
    "swiglu_untied": ["model=llama_debug"],
    "gelu_layernorm_biases": [
        "model=llama_debug",
        "model/ffn=gelu",
        "model/norm=layernorm",
        "model.decoder.layer.attention.qkv_projection.bias=true",
        "model.decoder.layer.attention.output_projection.bias=true",
        "model.decoder.layer.feed_forward.projection.bias=true",
        "model.decoder.layer.feed_forward.output_projection.bias=true",
    ],
    # Sandwich norms add a post-norm to each sublayer's residual module.
    "sandwich_norms": ["model=llama_debug", "model/norm=layernorm", "model/norm_placement=sandwich"],
}


@pytest.mark.parametrize("preset", ["replicated", "fsdp", "fsdp_tp"])
@pytest.mark.parametrize("variant", sorted(MODEL_VARIANTS))
def test_presets_cover_every_parameter_of_every_model_variant(preset, variant):
    config = load_experiment_config([f"sharding={preset}", *MODEL_VARIANTS[variant]])
    with torch.device("meta"):
        model = config.model.build()
    mesh = MeshConfig(data=2, fsdp=2, model=2).resolve(8)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    specs = resolve_parameter_specs(shapes, config.sharding, mesh)
    activations = resolve_activation_specs((n for n, _ in model.named_modules()), config.sharding, mesh)
    assert set(specs) == set(shapes)
    assert ("decoder.layers.1", "output", "hidden_states") in activations
    norms = [spec for name, spec in specs.items() if "norm" in name]
    assert norms and all(spec == (None,) for spec in norms)
    if preset == "fsdp_tp" and variant == "gelu_layernorm_biases":
        assert specs["decoder.layers.0.attention.q_proj.weight"] == (("model",), ("fsdp",))
        assert specs["decoder.layers.0.attention.q_proj.bias"] == (("model",),)
        assert specs["decoder.layers.0.feed_forward.down_proj.weight"] == (("fsdp",), ("model",))
        assert specs["decoder.layers.0.feed_forward.down_proj.bias"] == (None,)
        assert specs["decoder.final_norm.bias"] == (None,)


@pytest.mark.parametrize("preset", ["replicated", "fsdp", "fsdp_tp"])
def test_lora_adapters_split_over_model_as_their_base_does(preset):
    """Column-parallel base: B's output rows split, A whole; row-parallel base: A's input columns split, B whole."""
    overrides = [f"sharding={preset}", "model=llama_debug", "model/adapter=lora", "model.adapter.target=_proj"]
    config = load_experiment_config(overrides)
    with torch.device("meta"):
        model = config.model.build()
    config.model.adapter.build(torch.device("cpu")).apply(model)
    mesh = MeshConfig(data=2, fsdp=2, model=2).resolve(8)
    specs = resolve_parameter_specs({n: tuple(p.shape) for n, p in model.named_parameters()}, config.sharding, mesh)
    adapters = {name: spec for name, spec in specs.items() if ".adapter." in name}
    assert len(adapters) == 2 * 7 * 2  # 2 layers of 7 projections, A and B
    split = {name: spec for name, spec in adapters.items() if spec != (None, None)}
    if preset != "fsdp_tp":
        assert not split  # kept whole
        return
    column, row = r"(q|k|v|gate|up)_proj\.adapter\.lora_b", r"(o|down)_proj\.adapter\.lora_a"
    assert len(split) == 2 * 7
    for name, spec in split.items():
        expected = (("model",), None) if re.search(column, name) else (None, ("model",))
        assert (re.search(column, name) or re.search(row, name)) and spec == expected, name


def test_optional_rule_that_matches_nothing_still_needs_a_valid_spec():
    optional = ParameterRule(pattern=r".*_proj\.bias", spec=["tensor"], optional=True)
    error = _error([optional, VECTORS, MATRICES])
    assert error.key == "sharding.parameters[0].spec"


def test_dcn_slices_must_divide_their_axis():
    from axtorch.parallel.mesh import DcnMeshConfig, MeshConfig

    mesh = MeshConfig(data=4, fsdp=2, dcn=DcnMeshConfig(data=2))
    sizes = mesh.resolve(8)
    assert mesh.resolve_dcn(sizes)["data"] == 2
    bad = MeshConfig(data=4, fsdp=2, dcn=DcnMeshConfig(data=3))
    with pytest.raises(ConfigError, match=r"mesh\.dcn\.data"):
        bad.resolve_dcn(bad.resolve(8))


@pytest.mark.parametrize(
    ("mesh", "preset", "line"),
    [
        ([], "replicated", "replicated (mesh of one device)"),
        (["mesh.data=2"], "replicated", "replicated (mesh data=2)"),
        (["mesh.fsdp=-1"], "fsdp", "fsdp (mesh fsdp=-1)"),
        (["mesh.data=2", "mesh.fsdp=4"], "fsdp", "fsdp (mesh data=2 fsdp=4)"),
        (["mesh.fsdp=2", "mesh.model=2"], "fsdp_tp", "fsdp_tp (mesh fsdp=2 model=2)"),
        (["model=mixtral_tiny", "mesh.expert=2"], "fsdp_ep", "fsdp_ep (mesh expert=2)"),
    ],
)
def test_auto_sharding_follows_the_mesh_and_says_so(mesh, preset, line):
    composed = compose_experiment_config(mesh)
    assert composed.sharding.auto
    assert composed.sharding == compose_experiment_config([*mesh, f"sharding={preset}", "sharding.auto=true"]).sharding
    assert describe_auto_sharding(composed) == line


def test_an_explicit_preset_wins_over_auto():
    composed = compose_experiment_config(["mesh.fsdp=4", "sharding=replicated"])
    assert not composed.sharding.auto
    assert all(set(rule.spec) == {None} for rule in composed.sharding.parameters)


def test_auto_refuses_a_mesh_that_no_preset_serves():
    with pytest.raises(ConfigError) as error:
        load_experiment_config(["model=mixtral_tiny", "mesh.expert=2", "mesh.model=2"])
    assert (error.value.key, error.value.value) == ("sharding", "auto")
    assert "mesh.expert and mesh.model" in str(error.value)
