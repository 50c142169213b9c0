"""HF GPT-2 checkpoints -> ``from_hf`` -> ``to_hf`` -> transformers: the same logits in float64 at each hop."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from axtorch.infer.decoding import generate_ids
from axtorch.infer.sampling import SamplingConfig
from axtorch.interop import from_hf, to_hf
from axtorch.interop.families import config_from_hf
from axtorch.layers.attention_mask import SlidingWindowMaskConfig
from axtorch.layers.feed_forward import GatedFeedForwardConfig
from axtorch.layers.linear import LinearConfig
from axtorch.layers.norm import RMSNormConfig
from axtorch.layers.relative_position import RotaryEmbeddingConfig
from axtorch.models import CausalLMInput

SHAPE = dict(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=32, bos_token_id=None, eos_token_id=None)
#: case -> GPT2Config fields beyond SHAPE.
CASES = {
    "tied": {},
    "untied-relu-n_inner": dict(tie_word_embeddings=False, activation_function="relu", n_inner=96),
    "exact-gelu-eps": dict(activation_function="gelu", layer_norm_epsilon=1e-6),
}


@pytest.fixture
def hf_gpt2(random_hf_model):
    """A float64 HF GPT2LMHeadModel in eval mode, with every LayerNorm gain perturbed away from 1 too."""

    def build(**fields):
        model = random_hf_model(transformers.GPT2Config(**SHAPE, **fields))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".ln_" in name and name.endswith("weight"):
                    param.add_(0.1 * torch.randn_like(param))
        return model

    return build


def _ids(length=19):
    return torch.randint(0, SHAPE["vocab_size"], (2, length), generator=torch.Generator().manual_seed(1))


def _max_difference(model, hf_model, ids):
    return (model(CausalLMInput(input_ids=ids)).logits - hf_model(input_ids=ids).logits).abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_from_hf_logits_equal_transformers(case, tmp_path, hf_gpt2):
    hf_model = hf_gpt2(**CASES[case])
    hf_model.save_pretrained(tmp_path)

    model, config = from_hf(tmp_path, dtype=torch.float64)

    assert config.max_seq_len == 32 and config.tie_embeddings == (case != "untied-relu-n_inner")
    difference = _max_difference(model.eval(), hf_model, _ids())
    print(f"{case}: max |logits difference| {difference:.3g}")
    assert difference < 1e-10


def test_from_hf_reads_original_checkpoint_names_and_drops_mask_buffers(tmp_path, hf_gpt2):
    """openai-community/gpt2's file names tensors ``h.0.attn.c_attn.weight`` and stores ``attn.bias`` masks."""
    hf_model = hf_gpt2()
    hf_model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    original = {name.removeprefix("transformer."): tensor for name, tensor in saved.items()}
    for i in range(SHAPE["n_layer"]):
        original[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
        original[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(original, tmp_path / "model.safetensors", metadata={"format": "pt"})

    model, _ = from_hf(tmp_path, dtype=torch.float64)

    assert _max_difference(model.eval(), hf_model, _ids()) < 1e-10


@pytest.mark.parametrize("case", CASES)
def test_to_hf_loads_in_transformers_with_the_same_logits(case, tmp_path, hf_gpt2):
    hf_model = hf_gpt2(**CASES[case])
    hf_model.save_pretrained(tmp_path / "source")
    model, _ = from_hf(tmp_path / "source", dtype=torch.float64)

    to_hf(model, tmp_path / "export", max_shard_bytes=40_000)

    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["architectures"] == ["GPT2LMHeadModel"] and written["model_type"] == "gpt2"
    assert len(list((tmp_path / "export").glob("*.safetensors"))) > 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", dtype=torch.float64, attn_implementation="sdpa"
    ).eval()
    assert type(reloaded).__name__ == "GPT2LMHeadModel"
    ids = _ids()
    difference = (reloaded(input_ids=ids).logits - hf_model(input_ids=ids).logits).abs().max().item()
    print(f"{case}: max |logits difference| after to_hf {difference:.3g}")
    assert difference < 1e-10
    # The round trip reproduces the config too, dropout included.
    assert from_hf(tmp_path / "export")[1] == from_hf(tmp_path / "source")[1]


def test_kv_cache_greedy_generation_equals_repeated_full_forward(tmp_path, hf_gpt2):
    # Untied, with a position table large enough that the next token depends on the position
    # (a tied head with small random weights just repeats the last token).
    hf_model = hf_gpt2(tie_word_embeddings=False)
    with torch.no_grad():
        hf_model.transformer.wpe.weight.mul_(50)
    hf_model.save_pretrained(tmp_path)
    model, _ = from_hf(tmp_path, dtype=torch.float64)
    model.eval()
    prompt = [5, 17, 3, 90]

    generated = generate_ids(model, [prompt], 20, SamplingConfig())[0]

    ids = list(prompt)
    for _ in range(20):
        logits = model(CausalLMInput(input_ids=torch.tensor([ids]))).logits
        ids.append(int(logits[0, -1].argmax()))
    assert generated == ids[len(prompt) :]
    assert len(set(generated)) > 1  # a run that repeats one token would not exercise the positions


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
        ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=True"),
        ({"scale_attn_weights": False}, "scale_attn_weights=False"),
        ({"add_cross_attention": True}, "add_cross_attention=True"),
        ({"activation_function": "gelu_fast"}, "activation_function='gelu_fast'"),
    ],
)
def test_from_hf_refuses_gpt2_flags_axtorch_cannot_represent(fields, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", **SHAPE, **fields}))
    with pytest.raises(ValueError, match=re.escape(message)):
        from_hf(tmp_path)


def _tiny_gpt2_config():
    return config_from_hf({"model_type": "gpt2", **SHAPE})


def _set(path, value):
    def change(config):
        *parents, name = path.split(".")
        node = config
        for parent in parents:
            node = getattr(node, parent)
        setattr(node, name, value)

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set("decoder.layer.norm", RMSNormConfig()), "LayerNorms"),
        (_set("decoder.layer.attention.position", RotaryEmbeddingConfig()), "RotaryEmbeddingConfig"),
        (_set("decoder.layer.attention.mask", SlidingWindowMaskConfig(window=8)), "SlidingWindowMaskConfig"),
        (_set("decoder.layer.attention.num_kv_heads", 2), "2 key/value heads"),
        (_set("decoder.layer.attention.output_projection", LinearConfig(bias=False)), "attention projections"),
        (_set("decoder.layer.feed_forward", GatedFeedForwardConfig(hidden_dim=96)), "two-matrix MLP"),
        (_set("embedding.scale_by_sqrt_dim", True), "scaled token embeddings"),
    ],
)
def test_to_hf_refuses_what_gpt2_cannot_express(change, message, tmp_path):
    config = _tiny_gpt2_config()
    change(config)
    with torch.device("meta"):
        model = config.build()
    with pytest.raises(ValueError, match=message):
        to_hf(model, tmp_path)
    assert not any(tmp_path.iterdir())
