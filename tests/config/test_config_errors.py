"""Bad configuration fails before any compute, naming the key, the value and what is allowed."""

import pytest

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.parallel.execution import LayerRunnerKind


def _error(*overrides) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_experiment_config(list(overrides))
    return info.value


def test_unknown_key_lists_allowed_keys_and_suggests_the_closest():
    error = _error("trainer.max_step=5")
    assert error.key == "trainer.max_step"
    assert "max_steps" in error.allowed
    assert "did you mean trainer.max_steps" in str(error)


def test_unknown_key_of_a_chosen_child_is_checked_against_that_child():
    error = _error("data=text_files", "data.source.pathz=[a]")
    assert "paths" in error.allowed


def test_wrong_type_names_key_and_value():
    error = _error("trainer.max_steps=many")
    assert error.key == "trainer.max_steps"
    assert "many" in str(error)
    assert "int" in str(error).lower()


def test_invalid_enum_lists_choices():
    error = _error("trainer.precision=fp8")
    assert error.key == "trainer.precision"
    assert "bf16" in str(error) and "fp32" in str(error)


@pytest.mark.parametrize("override", ["trainer.max_steps=many", "trainer.precision=fp8"])
def test_the_key_is_named_under_a_debugger_too(monkeypatch, override):
    """OmegaConf chains its bare cause (a ValueError, no key) only under a tracer (a debugger, coverage)
    or OC_CAUSE=1: the error still names the key, not "<overrides>"."""
    monkeypatch.setenv("OC_CAUSE", "1")
    assert _error(override).key == override.partition("=")[0]


def test_unknown_group_option_lists_available_options():
    with pytest.raises(ConfigError) as info:
        load_experiment_config(["model/ffn=relu2"])
    assert "swiglu" in str(info.value) and "gelu" in str(info.value)


def test_heads_must_divide_width():
    error = _error("model.decoder.layer.attention.num_heads=5")
    assert error.key == "model.decoder.layer.attention.num_heads"
    assert error.value == 5
    assert "divisor of model.dim=192" in error.allowed


def test_kv_heads_must_divide_heads():
    error = _error("model.decoder.layer.attention.num_kv_heads=4")
    assert error.key == "model.decoder.layer.attention.num_kv_heads"
    assert "[1, 2, 3, 6]" in error.allowed


def test_sequence_longer_than_positions():
    error = _error("data.seq_len=2048")
    assert error.key == "data.seq_len"
    assert "model.max_seq_len=1024" in error.allowed


def test_batch_not_divisible_by_accumulation():
    error = _error("trainer.batch_size=16", "trainer.grad_accum_steps=3")
    assert error.key == "trainer.grad_accum_steps"
    assert "[1, 2, 4, 8, 16]" in error.allowed


def test_mesh_must_match_device_count():
    error = _error("mesh.fsdp=4")
    assert error.key == "mesh"
    assert "need 4 devices, found 1" in str(error)


def test_missing_required_value_is_named():
    error = _error("data=text_files")
    assert "data.source.paths" in str(error)


def test_swapping_a_child_is_a_config_change():
    from axtorch.layers.feed_forward import MLPFeedForwardConfig
    from axtorch.layers.norm import LayerNormConfig

    config = load_experiment_config(["model/ffn=gelu", "model/norm=layernorm"])
    assert isinstance(config.model.decoder.layer.feed_forward, MLPFeedForwardConfig)
    assert isinstance(config.model.decoder.layer.norm, LayerNormConfig)
    model = config.model.build()
    assert type(model.decoder.layers[0].feed_forward).__name__ == "MLPFeedForward"
    assert type(model.decoder.final_norm).__name__ == "LayerNorm"


def test_scanning_layers_needs_the_xla_backend():
    error = _error("execution.layer_runner=scan")
    assert error.key == "execution.layer_runner"
    assert "backend=xla" in error.allowed and "backend=single" in str(error)


def test_the_old_scan_layers_key_still_works_for_one_release_with_a_warning():
    with pytest.warns(FutureWarning, match=r"model.decoder.scan_layers is deprecated.*execution.layer_runner=scan"):
        config = load_experiment_config(["model.decoder.scan_layers=true", "backend=xla"])
    assert config.execution.layer_runner is LayerRunnerKind.scan


def test_context_parallelism_needs_sequences_that_cut_into_balanced_chunks():
    error = _error("experiment=debug", "backend=native", "mesh.seq=3")  # seq_len 64
    assert error.key == "data.seq_len" and error.value == 64
    assert "a multiple of 6 with mesh.seq=3 and backend=native" in str(error)
    assert _error("experiment=debug", "backend=xla", "mesh.seq=3").allowed.startswith("a multiple of 3 ")


def test_native_context_parallelism_refuses_a_mixture_of_experts():
    error = _error("experiment=debug", "model=mixtral_tiny", "backend=native", "mesh.seq=2")
    assert error.key == "mesh.seq" and "MixtureOfExpertsConfig" in str(error) and "load-balancing loss" in str(error)


def test_a_bf16_gradient_reduction_needs_bf16_compute():
    error = _error("trainer.reduce_precision=bf16")
    assert error.key == "trainer.reduce_precision" and "trainer.precision=bf16" in error.allowed
