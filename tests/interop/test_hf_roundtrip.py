"""HF checkpoint directories -> ``from_hf`` -> ``to_hf`` -> transformers: the same logits in float64 at each hop."""

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_shapes import HF_SHAPE

from axtorch.interop import from_hf, to_hf
from axtorch.interop.families import config_from_hf
from axtorch.layers.attention_mask import CausalMaskConfig, SlidingWindowMaskConfig
from axtorch.layers.feed_forward import MLPFeedForwardConfig
from axtorch.layers.linear import LinearConfig
from axtorch.layers.norm import LayerNormConfig, RMSNormConfig
from axtorch.layers.relative_position import (
    LinearScaledRotaryEmbeddingConfig,
    Llama3RotaryEmbeddingConfig,
    NoPositionConfig,
    RotaryEmbeddingConfig,
    YarnRotaryEmbeddingConfig,
)
from axtorch.models import CausalLMInput

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.models.llama.modeling_llama.LlamaRMSNorm),
    "mistral": (transformers.MistralConfig, transformers.models.mistral.modeling_mistral.MistralRMSNorm),
    "qwen2": (transformers.Qwen2Config, transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm),
    "qwen3": (transformers.Qwen3Config, transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm),
    "gemma": (transformers.GemmaConfig, transformers.models.gemma.modeling_gemma.GemmaRMSNorm),
}
SHAPE = {**HF_SHAPE, "rope_theta": 5000.0, "rms_norm_eps": 1e-5}


pytestmark = pytest.mark.usefixtures("float64_hf_rmsnorm")


def _hf_config(family: str, tie: bool, **overrides):
    config_class, _ = FAMILIES[family]
    return config_class(**SHAPE, tie_word_embeddings=tie, **overrides)


def _ids():
    return torch.randint(0, SHAPE["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(1))


LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=5000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
#: case -> (family, tied, HF config fields beyond SHAPE, architecture that to_hf writes back).
CASES = {
    "llama-biases": ("llama", False, dict(attention_bias=True, mlp_bias=True), "LlamaForCausalLM"),
    "llama-tied": ("llama", True, {}, "LlamaForCausalLM"),
    "llama-rope-llama3": ("llama", False, dict(rope_parameters=LLAMA3_ROPE), "LlamaForCausalLM"),
    # Pre-transformers-5 spelling: rope_scaling with "type" and a top-level rope_theta.
    "llama-rope-linear": ("llama", True, dict(rope_scaling={"type": "linear", "factor": 4.0}), "LlamaForCausalLM"),
    "llama-rope-yarn": (
        "llama",
        False,
        dict(
            rope_parameters=dict(rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=32)
        ),
        "LlamaForCausalLM",
    ),
    "mistral": ("mistral", False, dict(sliding_window=None), "LlamaForCausalLM"),
    "mistral-window": ("mistral", False, dict(sliding_window=5), "MistralForCausalLM"),
    "qwen2-tied": ("qwen2", True, {}, "Qwen2ForCausalLM"),
    "qwen2-window": (
        "qwen2",
        False,
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=0),
        "Qwen2ForCausalLM",
    ),
    "qwen3-tied": ("qwen3", True, dict(head_dim=16), "Qwen3ForCausalLM"),
    # GELU-tanh, sqrt(dim)-scaled embeddings, norms by 1 + weight.
    "gemma-tied": ("gemma", True, dict(head_dim=16), "GemmaForCausalLM"),
    "gemma-biases": ("gemma", False, dict(head_dim=32, attention_bias=True), "GemmaForCausalLM"),
    "qwen3-window-biases": (
        "qwen3",
        False,
        dict(head_dim=16, attention_bias=True, use_sliding_window=True, sliding_window=5, max_window_layers=0),
        "Qwen3ForCausalLM",
    ),
}
EXPORTABLE = [case for case, (*_, architecture) in CASES.items() if architecture is not None]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sharded", [False, True])
def test_from_hf_logits_equal_transformers(case, sharded, tmp_path, random_hf_model):
    family, tie, overrides, _ = CASES[case]
    hf_model = random_hf_model(_hf_config(family, tie, **overrides))
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded

    model, _ = from_hf(tmp_path, dtype=torch.float64)

    ids = _ids()
    difference = (model(CausalLMInput(input_ids=ids)).logits - hf_model(input_ids=ids).logits).abs().max()
    print(f"{case} sharded={sharded}: max |logits difference| {difference.item():.3g}")
    assert difference < 1e-10


@pytest.mark.parametrize("case", EXPORTABLE)
@pytest.mark.parametrize("max_shard_bytes", [5_000_000_000, 40_000])
def test_to_hf_loads_in_transformers_with_the_same_logits(case, max_shard_bytes, tmp_path, random_hf_model):
    family, tie, overrides, architecture = CASES[case]
    hf_model = random_hf_model(_hf_config(family, tie, **overrides))
    hf_model.save_pretrained(tmp_path / "source")
    model, _ = from_hf(tmp_path / "source", dtype=torch.float64)

    to_hf(model, tmp_path / "export", max_shard_bytes=max_shard_bytes)
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["architectures"] == [architecture] and written["torch_dtype"] == "float64"
    shards = sorted(p.name for p in (tmp_path / "export").glob("*.safetensors"))
    if max_shard_bytes < 5_000_000_000:
        assert len(shards) > 1 and (tmp_path / "export" / "model.safetensors.index.json").exists()
    else:
        assert shards == ["model.safetensors"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", dtype=torch.float64, attn_implementation="sdpa"
    ).eval()

    assert type(reloaded).__name__ == architecture
    ids = _ids()
    difference = (reloaded(input_ids=ids).logits - hf_model(input_ids=ids).logits).abs().max()
    print(f"{case} max_shard_bytes={max_shard_bytes}: max |logits difference| after to_hf {difference.item():.3g}")
    assert difference < 1e-10


def test_from_hf_reads_the_checkpoint_dtype_and_casts(tmp_path, random_hf_model):
    hf_model = random_hf_model(_hf_config("llama", tie=False)).to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path)

    model, _ = from_hf(tmp_path)

    assert all(p.dtype == torch.float32 and p.requires_grad and not p.is_meta for p in model.parameters())
    expected = hf_model.model.layers[1].mlp.down_proj.weight.float()
    assert torch.equal(model.decoder.layers[1].feed_forward.down_proj.weight, expected)


#: config.json fields (beyond a tiny shape) -> the axtorch attention config they import as.
FEATURE_CONFIGS = {
    "llama3": (
        {
            "model_type": "llama",
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        dict(position=Llama3RotaryEmbeddingConfig(theta=500000.0, factor=32.0, original_max_position_embeddings=8192)),
    ),
    "linear": (
        {"model_type": "llama", "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
        dict(position=LinearScaledRotaryEmbeddingConfig(theta=1e4, factor=2.0)),
    ),
    "yarn-factor-from-lengths": (  # YaRN's factor defaults to the context extension ratio
        {
            "model_type": "qwen3",
            "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 32768},
        },
        dict(
            position=YarnRotaryEmbeddingConfig(factor=4.0, original_max_position_embeddings=32768),
            head_dim=128,
            query_norm=RMSNormConfig(),
            key_norm=RMSNormConfig(),
        ),
    ),
    "mistral-default-window": (  # MistralConfig's sliding_window default applies when the field is absent
        {"model_type": "mistral"},
        dict(position=RotaryEmbeddingConfig(), mask=SlidingWindowMaskConfig(window=4096)),
    ),
    "qwen2-window-unused": (  # Qwen2 slides only from layer max_window_layers (28) on
        {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096},
        dict(position=RotaryEmbeddingConfig()),
    ),
}


@pytest.mark.parametrize("case", FEATURE_CONFIGS)
def test_from_hf_maps_each_feature_to_its_config(case):
    fields, expected = FEATURE_CONFIGS[case]
    config = {
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        **fields,
    }
    attention = config_from_hf(config).decoder.layer.attention
    for name, value in {"mask": CausalMaskConfig(), "query_norm": None, "key_norm": None, **expected}.items():
        assert getattr(attention, name) == value, name


@pytest.mark.parametrize(
    ("family", "fields", "message"),
    [
        ("gemma3_text", {"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
        (
            "llama",
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "lacks ['low_freq_factor', 'high_freq_factor']",
        ),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type='dynamic'"),
        ("llama", {"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_type='longrope'"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        (
            "llama",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
            "mscale",
        ),
        ("llama", {"sliding_window": 4096}, "sliding_window=4096"),
        ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
        ("qwen3", {"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
        ("llama", {"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
    ],
)
def test_from_hf_refuses_what_axtorch_cannot_represent(family, fields, message, tmp_path):
    config = {
        "model_type": family,
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        **fields,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(message)):
        from_hf(tmp_path)


def _tiny_llama_config():
    return config_from_hf({k: v for k, v in SHAPE.items() if k != "rope_theta"})


def _sliding_window_with_attention_biases(config):
    attention = config.decoder.layer.attention
    attention.mask = SlidingWindowMaskConfig(window=8)
    attention.qkv_projection = attention.output_projection = LinearConfig(bias=True)


def _qkv_biases_with_query_key_norms(config):
    attention = config.decoder.layer.attention
    attention.qkv_projection = LinearConfig(bias=True)  # Qwen2's biases, but Qwen2 has no QK-norm
    attention.query_norm = attention.key_norm = RMSNormConfig(eps=config.decoder.layer.norm.eps)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: setattr(c.decoder.layer, "norm", LayerNormConfig()), "LayerNormConfig"),
        (lambda c: setattr(c.decoder.layer, "feed_forward", MLPFeedForwardConfig(hidden_dim=160)), "gated MLP"),
        (lambda c: setattr(c.decoder.layer.attention, "position", NoPositionConfig()), "RoPE"),
        (_qkv_biases_with_query_key_norms, "Qwen3ForCausalLM: bias on the q/k/v projections but not the output"),
        (lambda c: setattr(c.decoder.layer.attention, "query_norm", RMSNormConfig(eps=1e-5)), "query/key norms"),
        (lambda c: setattr(c.decoder.layer.attention, "key_norm", LayerNormConfig()), "query/key norms"),
        (_sliding_window_with_attention_biases, "MistralForCausalLM: attention biases"),
    ],
)
def test_to_hf_refuses_what_no_hf_family_can_express(change, message, tmp_path):
    config = _tiny_llama_config()
    change(config)
    with torch.device("meta"):
        model = config.build()
    with pytest.raises(ValueError, match=message):
        to_hf(model, tmp_path)
    assert not any(tmp_path.iterdir())
