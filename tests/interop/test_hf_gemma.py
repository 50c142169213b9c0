"""Gemma 2 and Gemma 3 (random weights) through HF and GGUF, both ways: the logits of transformers in float64.

Their layers differ (sliding-window and global, Gemma 3's local RoPE base), so each import is a
decoder with variants; seven layers run the pattern past one period.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_shapes import HF_SHAPE

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.data.tokenizer import train_byte_level_bpe
from axtorch.interop import from_hf, to_hf
from axtorch.interop.families import CannotExpress, config_from_hf, family_of
from axtorch.interop.gguf import from_gguf
from axtorch.interop.gguf_export import to_gguf
from axtorch.layers.attention_kernel import SoftcappedKernelConfig
from axtorch.layers.attention_mask import CausalMaskConfig, SlidingWindowMaskConfig
from axtorch.layers.relative_position import RotaryEmbeddingConfig
from axtorch.layers.residual import SandwichNormResidualConfig
from axtorch.layers.softcap import SoftCapConfig
from axtorch.models import CausalLMInput

pytestmark = pytest.mark.usefixtures("float64_hf_rmsnorm")

SHAPE = {**HF_SHAPE, "num_hidden_layers": 7, "head_dim": 16, "sliding_window": 5, "query_pre_attn_scalar": 24}
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 50000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
}
#: case -> (HF config, the attention HF runs: soft-capped scores need its eager path).
CASES = {
    "gemma2": (
        lambda **fields: transformers.Gemma2Config(
            **{"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "tie_word_embeddings": False, **fields}
        ),
        "eager",
    ),
    "gemma3": (lambda **fields: transformers.Gemma3TextConfig(**{"rope_parameters": GEMMA3_ROPE, **fields}), "sdpa"),
}


def _hf_model(case, random_hf_model, **shape):
    make, attention = CASES[case]
    return random_hf_model(make(**{**SHAPE, **shape}), attention)


def _ids(vocab_size=SHAPE["vocab_size"]):
    return torch.randint(0, vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", CASES)
def test_from_hf_and_to_hf_give_transformers_logits(case, tmp_path, random_hf_model):
    hf_model = _hf_model(case, random_hf_model)
    hf_model.save_pretrained(tmp_path / "source")
    model, _ = from_hf(tmp_path / "source", dtype=torch.float64)
    ids = _ids()
    expected = hf_model(input_ids=ids).logits
    difference = (model(CausalLMInput(input_ids=ids)).logits - expected).abs().max().item()
    print(f"{case}: max |logits difference| {difference:.3g}")
    assert difference < 1e-10

    to_hf(model, tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["architectures"] == [type(hf_model).__name__]
    assert written["layer_types"] == hf_model.config.layer_types
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", dtype=torch.float64, attn_implementation=CASES[case][1]
    ).eval()
    difference = (reloaded(input_ids=ids).logits - expected).abs().max().item()
    print(f"{case}: max |logits difference| after to_hf {difference:.3g}")
    assert difference < 1e-10


def test_gemma3_maps_to_five_local_layers_and_a_global_one(random_hf_model):
    config = config_from_hf(_hf_model("gemma3", random_hf_model).config)
    decoder = config.decoder
    assert decoder.pattern == ["local"] * 5 + ["global"]
    layers = decoder.layer_configs()
    local, full = SlidingWindowMaskConfig(window=5), CausalMaskConfig()
    assert [layer.attention.mask for layer in layers] == [local] * 5 + [full, local]
    local_rope, global_rope = RotaryEmbeddingConfig(theta=100.0), RotaryEmbeddingConfig(theta=50000.0)
    assert [layer.attention.position for layer in layers] == [local_rope] * 5 + [global_rope, local_rope]
    assert type(layers[0].residual) is SandwichNormResidualConfig and layers[0].attention.query_norm is not None
    assert layers[0].attention.softmax_scale == 24**-0.5 and config.logit_softcap is None


def test_gemma2_soft_caps_scores_and_logits(random_hf_model):
    config = config_from_hf(_hf_model("gemma2", random_hf_model).config)
    assert config.decoder.pattern == ["local", "global"]
    assert config.decoder.layer.attention.kernel == SoftcappedKernelConfig(cap=2.0)
    assert config.logit_softcap == SoftCapConfig(cap=3.0)


def test_gemma2_cannot_express_local_layers_with_a_rope_of_their_own(random_hf_model):
    config = config_from_hf(_hf_model("gemma2", random_hf_model).config)
    config.decoder.variants["local"]["attention"]["position"] = {"theta": 100.0}
    with pytest.raises(CannotExpress, match="local layers with a RoPE of their own"):
        family_of("gemma2").config_to_hf(config)


def test_a_fused_head_loss_refuses_soft_capped_logits(random_hf_model):
    config = config_from_hf(_hf_model("gemma2", random_hf_model).config)
    model = config.build()
    with pytest.raises(ValueError, match=r"logit_softcap=SoftCapConfig\(cap=3.0\) cannot apply to a loss fused"):
        model(CausalLMInput(_ids(), head_fn=lambda *tensors: tensors))


@pytest.fixture(scope="module")
def tokenizer():
    corpus = "def main():\n    return 0\n" * 40 + "the quick brown fox jumps over the lazy dog 12345\n" * 40
    return train_byte_level_bpe(iter([corpus]), 300, "<|endoftext|>")


@pytest.mark.parametrize("case", CASES)
def test_gguf_export_reads_back_in_axtorch_and_transformers(case, tmp_path, random_hf_model, tokenizer):
    """llama.cpp's Gemma files keep only the window: the reader supplies the layer pattern, the
    local RoPE base (10,000) and the score scale (1/sqrt(head_dim)), as transformers does."""
    rope = {"rope_parameters": None} if case == "gemma3" else {}
    # Tied as the released models are (transformers' GGUF loader reads no Gemma 2 output.weight).
    shape = dict(vocab_size=300, head_dim=256, query_pre_attn_scalar=256, num_attention_heads=2, **rope)
    shape["tie_word_embeddings"] = True
    caps = dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0) if case == "gemma2" else {}
    hf_model = _hf_model(case, random_hf_model, **shape, **caps)
    hf_model.save_pretrained(tmp_path / "source")
    model, _ = from_hf(tmp_path / "source", dtype=torch.float64)
    to_gguf(model.float(), tokenizer, tmp_path / "model.gguf", "f32")

    ids = _ids(300)
    expected = hf_model(input_ids=ids).logits
    ours, config, _ = from_gguf(tmp_path / "model.gguf", dtype=torch.float64)
    assert config.decoder.pattern == model.config.decoder.pattern
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf", dtype=torch.float64, attn_implementation=CASES[case][1]
    ).eval()
    for reader, got in (("axtorch", ours(CausalLMInput(ids)).logits), ("transformers", theirs(input_ids=ids).logits)):
        difference = (got - expected).abs().max().item()
        print(f"{case}: max |logits difference| {reader} from the exported GGUF {difference:.3g}")
        assert difference < 1e-5  # the weights went through float32


def test_gguf_export_refuses_what_llama_cpp_would_run_otherwise(tmp_path, tokenizer):
    config = load_experiment_config(["experiment=debug", "model=gemma3_tiny", "model.vocab_size=300"]).model
    model = config.build()
    model.init_weights()
    to_gguf(model, tokenizer, tmp_path / "tiny.gguf", "f32")  # the preset is what llama.cpp runs
    config.decoder.pattern = ["local", "local", "global"]
    with pytest.raises(ValueError, match=r"llama\.cpp's gemma3 cannot express layer_types="):
        to_gguf(config.build(), tokenizer, tmp_path / "other.gguf", "f32")
