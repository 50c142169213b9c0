"""HF checkpoint directories -> ``from_hf`` -> ``to_hf`` -> transformers: the same logits in float64 at each hop."""

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from axtorch.interop import from_hf, to_hf
from axtorch.interop.hf_llama import llama_config_from_hf
from axtorch.layers.feed_forward import MLPFeedForwardConfig
from axtorch.layers.linear import LinearConfig
from axtorch.layers.norm import LayerNormConfig
from axtorch.layers.position import NoPositionConfig
from axtorch.models import CausalLMInput

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.models.llama.modeling_llama.LlamaRMSNorm),
    "mistral": (transformers.MistralConfig, transformers.models.mistral.modeling_mistral.MistralRMSNorm),
    "qwen2": (transformers.Qwen2Config, transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm),
}
SHAPE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, rope_theta=5000.0, rms_norm_eps=1e-5, max_position_embeddings=128,
)


pytestmark = pytest.mark.usefixtures("float64_hf_rmsnorm")


def _hf_model(family: str, tie: bool, **overrides):
    config_class, _ = FAMILIES[family]
    config = config_class(**SHAPE, tie_word_embeddings=tie, **overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb so they are tested
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def _ids():
    return torch.randint(0, SHAPE["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(1))


CASES = {
    "llama-biases": ("llama", False, dict(attention_bias=True, mlp_bias=True)),
    "llama-tied": ("llama", True, {}),
    "mistral": ("mistral", False, dict(sliding_window=None)),
    "qwen2-tied": ("qwen2", True, {}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sharded", [False, True])
def test_from_hf_logits_equal_transformers(case, sharded, tmp_path):
    family, tie, overrides = CASES[case]
    hf_model = _hf_model(family, tie, **overrides)
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded

    model, _ = from_hf(tmp_path, dtype=torch.float64)

    ids = _ids()
    difference = (model(CausalLMInput(input_ids=ids)).logits - hf_model(input_ids=ids).logits).abs().max()
    print(f"{case} sharded={sharded}: max |logits difference| {difference.item():.3g}")
    assert difference < 1e-10


@pytest.mark.parametrize("case", ["llama-biases", "llama-tied", "mistral"])
@pytest.mark.parametrize("max_shard_bytes", [5_000_000_000, 40_000])
def test_to_hf_loads_in_transformers_with_the_same_logits(case, max_shard_bytes, tmp_path):
    family, tie, overrides = CASES[case]
    hf_model = _hf_model(family, tie, **overrides)
    hf_model.save_pretrained(tmp_path / "source")
    model, _ = from_hf(tmp_path / "source", dtype=torch.float64)

    to_hf(model, tmp_path / "export", max_shard_bytes=max_shard_bytes)
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"] and written["torch_dtype"] == "float64"
    shards = sorted(p.name for p in (tmp_path / "export").glob("*.safetensors"))
    if max_shard_bytes < 5_000_000_000:
        assert len(shards) > 1 and (tmp_path / "export" / "model.safetensors.index.json").exists()
    else:
        assert shards == ["model.safetensors"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", dtype=torch.float64, attn_implementation="sdpa"
    ).eval()

    assert isinstance(reloaded, transformers.LlamaForCausalLM)
    ids = _ids()
    difference = (reloaded(input_ids=ids).logits - hf_model(input_ids=ids).logits).abs().max()
    print(f"{case} max_shard_bytes={max_shard_bytes}: max |logits difference| after to_hf {difference.item():.3g}")
    assert difference < 1e-10


def test_from_hf_reads_the_checkpoint_dtype_and_casts(tmp_path):
    hf_model = _hf_model("llama", tie=False).to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path)

    model, _ = from_hf(tmp_path)

    assert all(p.dtype == torch.float32 and p.requires_grad and not p.is_meta for p in model.parameters())
    expected = hf_model.model.layers[1].mlp.down_proj.weight.float()
    assert torch.equal(model.decoder.layers[1].feed_forward.down_proj.weight, expected)


@pytest.mark.parametrize(
    ("family", "fields", "message"),
    [
        ("gpt2", {}, "model_type='gpt2'"),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.rope_type='llama3'"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.rope_type='yarn'"),
        ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type='linear'"),
        ("mistral", {"sliding_window": 4096}, "sliding_window=4096"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4096}, "sliding_window=4096"),
        ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
        ("llama", {"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
    ],
)
def test_from_hf_refuses_what_axtorch_cannot_represent(family, fields, message, tmp_path):
    config = {
        "model_type": family, "vocab_size": 97, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 8, **fields,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(message)):
        from_hf(tmp_path)


def _tiny_llama_config():
    return llama_config_from_hf({k: v for k, v in SHAPE.items() if k != "rope_theta"})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: setattr(c.decoder.layer, "norm", LayerNormConfig()), "LayerNormConfig"),
        (lambda c: setattr(c.decoder.layer, "feed_forward", MLPFeedForwardConfig(hidden_dim=160)), "gated MLP"),
        (lambda c: setattr(c.decoder.layer.attention, "position", NoPositionConfig()), "RoPE"),
        (lambda c: setattr(c.decoder.layer.attention, "qkv_projection", LinearConfig(bias=True)), "q/k/v"),
    ],
)
def test_to_hf_refuses_what_llama_cannot_express(change, message, tmp_path):
    config = _tiny_llama_config()
    change(config)
    with torch.device("meta"):
        model = config.build()
    with pytest.raises(ValueError, match=message):
        to_hf(model, tmp_path)
    assert not any(tmp_path.iterdir())
