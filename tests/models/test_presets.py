"""The model presets have the published shapes: their parameter counts match the released models'."""

import pytest
from meta_presets import build_on_meta

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.interop.families import config_from_hf
from axtorch.interop.pretrained import check_same_architecture
from axtorch.layers.attention_mask import SlidingWindowMaskConfig
from axtorch.layers.norm import RMSNormConfig
from axtorch.layers.relative_position import Llama3RotaryEmbeddingConfig
from axtorch.parallel.mesh import MeshConfig
from axtorch.parallel.sharding import resolve_parameter_specs

#: preset -> (vocabulary size, parameter count published on the model card or as the HF
#: safetensors total).
PUBLISHED_PARAMETERS = {
    "llama3_1b": (128256, 1.24e9),
    "llama3_3b": (128256, 3.21e9),
    "llama3_8b": (128256, 8.03e9),
    "llama3_70b": (128256, 70.6e9),
    "llama3_405b": (128256, 405.9e9),
    "mistral_7b": (32000, 7.24e9),
    "qwen3_0_6b": (151936, 0.596e9),
    "qwen3_8b": (151936, 8.19e9),
    "smollm2_135m": (49152, 134.5e6),
    "mixtral_8x7b": (32000, 46.7e9),
    "qwen3_30b_a3b": (151936, 30.5e9),
    "gpt2_124m": (50257, 124_439_808),
    "gpt2_355m": (50257, 354_823_168),
    "gpt2_774m": (50257, 774_030_080),
    "gpt2_1_5b": (50257, 1_557_611_200),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMETERS))
def test_preset_parameter_count_matches_the_published_figure(preset):
    config, model = build_on_meta(f"model={preset}")
    vocab_size, published = PUBLISHED_PARAMETERS[preset]
    count = sum(p.numel() for p in model.parameters())
    assert count == pytest.approx(published, rel=0.01)
    assert config.model.vocab_size == vocab_size


def test_qwen3_0_6b_has_0_44b_parameters_besides_the_embedding():
    _, model = build_on_meta("model=qwen3_0_6b")
    count = sum(p.numel() for name, p in model.named_parameters() if name != "embedding.weight")
    assert count == pytest.approx(0.44e9, rel=0.01)


@pytest.mark.parametrize(
    ("preset", "factor"),
    [("llama3_1b", 32.0), ("llama3_3b", 32.0), ("llama3_8b", 8.0), ("llama3_70b", 8.0), ("llama3_405b", 8.0)],
)
def test_llama3_presets_use_the_released_rope_scaling(preset, factor):
    position = load_experiment_config([f"model={preset}"]).model.decoder.layer.attention.position
    assert position == Llama3RotaryEmbeddingConfig(
        theta=500000.0, factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )


def test_mistral_and_qwen3_presets_select_their_features_by_config():
    mistral = load_experiment_config(["model=mistral_7b"]).model.decoder.layer.attention
    assert mistral.mask == SlidingWindowMaskConfig(window=4096) and mistral.query_norm is None
    qwen3 = load_experiment_config(["model=qwen3_0_6b"]).model.decoder.layer.attention
    assert qwen3.query_norm == qwen3.key_norm == RMSNormConfig(eps=1e-6)
    assert qwen3.head_dim == 128 != 1024 // qwen3.num_heads
    # QK-norm is one group choice on any preset.
    llama = load_experiment_config(["model=llama_debug", "model/qk_norm=rmsnorm"]).model.decoder.layer.attention
    assert llama.query_norm == llama.key_norm == RMSNormConfig()


@pytest.mark.parametrize("sharding", ["replicated", "fsdp", "fsdp_tp"])
@pytest.mark.parametrize("preset", ["mistral_7b", "qwen3_0_6b"])
def test_sharding_presets_cover_every_parameter_including_qk_norms(preset, sharding):
    config, model = build_on_meta(f"model={preset}", f"sharding={sharding}")
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    specs = resolve_parameter_specs(shapes, config.sharding, MeshConfig(fsdp=2, model=2).resolve(4))
    assert set(specs) == set(shapes)
    norms = {name: spec for name, spec in specs.items() if "norm" in name}
    assert all(spec == (None,) for spec in norms.values())
    if preset == "qwen3_0_6b":
        assert "decoder.layers.27.attention.query_norm.weight" in norms
        assert "decoder.layers.27.attention.key_norm.weight" in norms


_SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
)
#: preset -> the released config.json (the fields that matter): ``init_from`` needs the preset to
#: describe exactly the network ``from_hf`` builds from it.
RELEASED_HF_CONFIGS = {
    "llama3_1b": dict(
        zip(_SHAPE_KEYS, (128256, 2048, 8192, 16, 32, 8, 1e-5, 500000.0, True)),
        model_type="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "llama3_8b": dict(
        zip(_SHAPE_KEYS, (128256, 4096, 14336, 32, 32, 8, 1e-5, 500000.0, False)),
        model_type="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "mistral_7b": dict(
        zip(_SHAPE_KEYS, (32000, 4096, 14336, 32, 32, 8, 1e-5, 10000.0, False)),
        model_type="mistral",
        sliding_window=4096,
    ),
    "qwen3_0_6b": dict(
        zip(_SHAPE_KEYS, (151936, 1024, 3072, 28, 16, 8, 1e-6, 1000000.0, True)),
        model_type="qwen3",
        head_dim=128,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
    ),
    "qwen3_8b": dict(
        zip(_SHAPE_KEYS, (151936, 4096, 12288, 36, 32, 8, 1e-6, 1000000.0, False)),
        model_type="qwen3",
        head_dim=128,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=36,
    ),
    "smollm2_135m": dict(zip(_SHAPE_KEYS, (49152, 576, 1536, 30, 9, 3, 1e-5, 100000.0, True)), model_type="llama"),
    "mixtral_8x7b": dict(
        zip(_SHAPE_KEYS, (32000, 4096, 14336, 32, 32, 8, 1e-5, 1000000.0, False)),
        model_type="mixtral",
        sliding_window=None,
        num_local_experts=8,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
    ),
    "qwen3_30b_a3b": dict(
        zip(_SHAPE_KEYS, (151936, 2048, 6144, 48, 32, 4, 1e-6, 1000000.0, False)),
        model_type="qwen3_moe",
        head_dim=128,
        use_sliding_window=False,
        sliding_window=None,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
    ),
}


@pytest.mark.parametrize("preset", sorted(RELEASED_HF_CONFIGS))
def test_preset_is_the_network_that_the_released_hf_config_imports_as(preset):
    ours = load_experiment_config([f"model={preset}"]).model
    check_same_architecture(ours, config_from_hf(RELEASED_HF_CONFIGS[preset]), f"hf:{preset}")
