"""GPT-2 presets: the released networks exactly, covered by every sharding preset, plannable, and trainable on a CPU."""

import math

import pytest
from meta_presets import build_on_meta

from axtorch.cli.plan import main
from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.interop.families import config_from_hf
from axtorch.interop.pretrained import check_same_architecture
from axtorch.parallel.mesh import MeshConfig
from axtorch.parallel.sharding import resolve_parameter_specs
from axtorch.plan import load_plan_inputs, plan
from axtorch.train.flops import transformer_flops_per_token
from axtorch.train.trainer import Trainer

#: preset -> (n_embd, n_layer, n_head) of the released config.json, and HF's exact parameter count.
RELEASED = {
    "gpt2_124m": ((768, 12, 12), 124_439_808),
    "gpt2_355m": ((1024, 24, 16), 354_823_168),
    "gpt2_774m": ((1280, 36, 20), 774_030_080),
    "gpt2_1_5b": ((1600, 48, 25), 1_557_611_200),
}


def _released_hf_config(preset):
    (n_embd, n_layer, n_head), _ = RELEASED[preset]
    # The fields of openai-community/gpt2*'s config.json that matter; the rest are GPT2Config's defaults.
    return {
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "attn_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "resid_pdrop": 0.1,
        "layer_norm_epsilon": 1e-5,
        "n_ctx": 1024,
        "n_positions": 1024,
        "n_embd": n_embd,
        "n_layer": n_layer,
        "n_head": n_head,
        "vocab_size": 50257,
    }


@pytest.mark.parametrize("preset", sorted(RELEASED))
def test_preset_is_the_released_network_with_hf_s_exact_parameter_count(preset):
    config, model = build_on_meta(f"model={preset}")
    check_same_architecture(config.model, config_from_hf(_released_hf_config(preset)), f"hf:{preset}")
    assert sum(p.numel() for p in model.parameters()) == RELEASED[preset][1]


def test_init_from_refuses_a_preset_whose_position_table_has_another_length():
    ours = load_experiment_config(["model=gpt2_124m", "model.max_seq_len=2048"]).model
    with pytest.raises(ConfigError, match=r"model\.max_seq_len=2048 vs 1024"):
        check_same_architecture(ours, config_from_hf(_released_hf_config("gpt2_124m")), "hf:gpt2")


@pytest.mark.parametrize("sharding", ["replicated", "fsdp", "fsdp_tp"])
def test_sharding_presets_cover_the_position_table_and_every_bias(sharding):
    # 50257 splits over no even axis; padded as nanoGPT pads it, the vocabulary splits over fsdp x model.
    config, model = build_on_meta("model=gpt2_124m", "model.vocab_size=50304", f"sharding={sharding}")
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    specs = resolve_parameter_specs(shapes, config.sharding, MeshConfig(fsdp=2, model=2).resolve(4))
    assert set(specs) == set(shapes)
    assert specs["position_embedding.weight"] == ((None, None) if sharding == "replicated" else (("fsdp",), None))
    one_dimensional = [name for name, shape in shapes.items() if len(shape) == 1]
    assert "decoder.layers.11.attention_norm.bias" in one_dimensional and "decoder.final_norm.bias" in one_dimensional
    if sharding == "fsdp_tp":
        assert specs["decoder.layers.0.attention.q_proj.bias"] == (("model",),)
        assert specs["decoder.layers.0.feed_forward.down_proj.bias"] == (None,)


def test_the_released_vocabulary_under_fsdp_is_a_config_error_naming_it():
    config, mesh_sizes = load_plan_inputs(["model=gpt2_124m", "mesh.fsdp=4", "sharding=fsdp"])
    with pytest.raises(ConfigError, match="dim 0 has size 50257, not divisible by fsdp=4"):
        plan(config, mesh_sizes)


def test_sharding_auto_names_itself_when_its_preset_cannot_split_the_released_vocabulary():
    config, mesh_sizes = load_plan_inputs(["model=gpt2_124m", "mesh.fsdp=4"])
    with pytest.raises(ConfigError, match="not divisible by fsdp=4 \\(sharding=auto chose this preset"):
        plan(config, mesh_sizes)


def test_plan_command_sizes_gpt2_and_counts_no_flops_for_the_position_table(capsys):
    assert main(["model=gpt2_124m", "mesh.fsdp=4", "sharding=replicated"]) == 0
    assert "total parameters: 124,439,808" in capsys.readouterr().out

    config, mesh_sizes = load_plan_inputs(["model=gpt2_124m", "mesh.fsdp=4", "sharding=fsdp", "model.vocab_size=50304"])
    result = plan(config, mesh_sizes, seq_len=1024)
    model = config.model
    tables = (model.vocab_size + model.max_seq_len) * model.dim
    assert result.flops_per_token == transformer_flops_per_token(
        result.total_parameters - tables, 12, 768, 1024, model.vocab_size, tied=True
    )
    assert result.memory.parameter_bytes == pytest.approx(4 * result.total_parameters / 4, rel=0.01)


def test_gpt2_tiny_learns_on_the_cpu(tmp_path, data_cache):
    config = load_experiment_config(
        [
            "experiment=debug",
            "model=gpt2_tiny",
            f"run_dir={tmp_path / 'run'}",
            f"data.cache_dir={data_cache}",
            "trainer.progress_bar=false",
            "trainer.max_steps=20",
        ]
    )
    result = Trainer(config).fit()
    assert result.step == 20
    assert math.isfinite(result.final_eval_loss)
    assert result.final_eval_loss < result.initial_eval_loss - 0.5
