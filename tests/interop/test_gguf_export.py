"""GGUF export: files that transformers' GGUF loader and axtorch's reader load with the model's logits.

Exact in f32; in f16 equal to the model with its weight matrices rounded to f16; in q8_0 close.
The tokenizer comes back identical. ``axtorch-export`` writes the same files from a trained run.
"""

import copy
import json
import subprocess
import sys

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.data.tokenizer import train_byte_level_bpe
from axtorch.interop.gguf import from_gguf, tokenizer_from_gguf, tokenizer_settings
from axtorch.interop.gguf_export import to_gguf
from axtorch.models import CausalLMInput
from axtorch.train.trainer import Trainer

transformers = pytest.importorskip("transformers")
GGUFReader = pytest.importorskip("gguf").GGUFReader

TEXTS = [
    "def main():\n    return 0",
    "The quick brown fox, 12345 and 6.78!",
    "  spaces   and\ttabs\n\n",
    "unicode: café, naïve, 日本語, emoji 🚀",
    "<|endoftext|>after the end",
]


@pytest.fixture(scope="module")
def tokenizer():
    corpus = "def main():\n    return 0\n" * 40 + "the quick brown fox jumps over the lazy dog 12345\n" * 40
    return train_byte_level_bpe(iter([corpus + "café naïve 日本語 🚀\n" * 10]), 320, "<|endoftext|>")


def _model(tokenizer, *overrides):
    torch.manual_seed(0)
    # The vocabulary is padded past the tokenizer's, as a user's model may be.
    config = load_experiment_config(["experiment=debug", f"model.vocab_size={tokenizer.vocab_size + 5}", *overrides])
    model = config.model.build()
    model.init_weights()
    return model.eval()


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_transformers_and_axtorch_load_the_exported_file_with_the_models_logits(tmp_path, tokenizer, dtype, tied):
    model = _model(tokenizer, f"model.tie_embeddings={tied}")
    to_gguf(model, tokenizer, tmp_path / "model.gguf", dtype)
    ids = torch.tensor([tokenizer.encode(" ".join(TEXTS))])
    expected = model(CausalLMInput(ids)).logits
    if dtype == "f16":  # the reference: the same model with its weight matrices rounded to f16
        rounded = _model(tokenizer, f"model.tie_embeddings={tied}")
        with torch.no_grad():
            for param in rounded.parameters():
                if param.dim() == 2:
                    param.copy_(param.half().float())
        expected = rounded(CausalLMInput(ids)).logits
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float32)
    ours, _, read_tokenizer = from_gguf(tmp_path / "model.gguf")
    with torch.no_grad():
        hf_logits = theirs(ids).logits
        our_logits = ours(CausalLMInput(ids)).logits
    tolerance = {"f32": 1e-6, "f16": 1e-5, "q8_0": 3e-2}[dtype]
    assert _relative(hf_logits, expected) < tolerance
    assert _relative(our_logits, expected) < tolerance
    assert all(read_tokenizer.encode(text) == tokenizer.encode(text) for text in TEXTS)


def test_transformers_reads_the_exported_tokenizer_as_it_was(tmp_path, tokenizer):
    to_gguf(_model(tokenizer), tokenizer, tmp_path / "model.gguf", "f32")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf")
    for text in TEXTS:
        assert theirs(text, add_special_tokens=False).input_ids == tokenizer.encode(text), text


def test_a_chat_tokenizers_template_and_end_of_turn_token_go_into_the_file(tmp_path, tokenizer):
    """A run from init_from=gguf has the GGUF's tokenizer_config.json settings beside its tokenizer:
    the exported file carries the template, and its EOS is the settings' end-of-turn token."""
    end_of_turn = tokenizer.decode([300])
    chat = copy.copy(tokenizer)
    chat.settings = {
        "chat_template": "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
        "eos_token": end_of_turn,
    }
    to_gguf(_model(tokenizer), chat, tmp_path / "chat.gguf", "f32")
    expected = {"bos_token": "<|endoftext|>", "add_bos_token": False, **chat.settings}
    assert tokenizer_settings(tmp_path / "chat.gguf") == expected
    to_gguf(_model(tokenizer), tokenizer, tmp_path / "plain.gguf", "f32")
    plain = tokenizer_settings(tmp_path / "plain.gguf")
    assert plain == {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_bos_token": False}


def test_what_no_gguf_architecture_can_express_is_refused_before_writing(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="no GGUF layout for HF model_type='gpt2'"):
        to_gguf(_model(tokenizer, "model=gpt2_tiny"), tokenizer, tmp_path / "gpt2.gguf")
    unnormalised = _model(
        tokenizer, "model=qwen3_moe_tiny", "model.decoder.layer.feed_forward.router.normalize_top_k=false"
    )
    with pytest.raises(ValueError, match="qwen3moe cannot express top-k weights that are not renormalised"):
        to_gguf(unnormalised, tokenizer, tmp_path / "qwen3moe.gguf")
    with pytest.raises(ValueError, match="GGUF dtype 'q4_k' is not supported; supported: f32, f16, bf16, q8_0"):
        to_gguf(_model(tokenizer), tokenizer, tmp_path / "q4.gguf", "q4_k")
    assert not list(tmp_path.iterdir())


def _export(*arguments):
    return subprocess.run([sys.executable, "-m", "axtorch.export", *arguments], capture_output=True, text=True)


@pytest.mark.journey
def test_the_export_command_writes_gguf_and_hf_from_a_trained_run(tmp_path, data_cache):
    overrides = ["experiment=debug", f"run_dir={tmp_path / 'run'}", f"data.cache_dir={data_cache}"]
    trainer = Trainer(load_experiment_config([*overrides, "trainer.max_steps=2", "trainer.progress_bar=false"]))
    trainer.fit()
    run = f"checkpoint={tmp_path / 'run'}"
    ids = torch.tensor([trainer.data.tokenizer.encode("import os\ndef main():")])
    expected = trainer.model.eval()(CausalLMInput(ids)).logits

    gguf = _export(run, f"to=gguf:{tmp_path / 'run.gguf'}", "dtype=f32")
    assert gguf.returncode == 0, gguf.stderr[-2000:]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="run.gguf", dtype=torch.float32)
    assert _relative(theirs(ids).logits, expected) < 1e-6

    hf = _export(run, f"to=hf:{tmp_path / 'hf'}")
    assert hf.returncode == 0, hf.stderr[-2000:]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert _relative(theirs(ids).logits, expected) < 1e-6
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tokenizer("import os\ndef main():", add_special_tokens=False).input_ids == ids[0].tolist()
    assert hf_tokenizer.eos_token == "<|endoftext|>"

    bad_target = _export(run, "to=onnx:model.onnx")
    assert bad_target.returncode == 2 and "gguf:FILE or hf:DIR" in bad_target.stderr
    bad_dtype = _export(run, f"to=gguf:{tmp_path / 'x.gguf'}", "dtype=q4_k")
    assert (
        bad_dtype.returncode == 2 and "one of f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0 for gguf" in bad_dtype.stderr
    )


def _with_pre_tokenizer(tokenizer, name, ignore_merges=None):
    """The same vocabulary and merges behind another of llama.cpp's pre-tokenizers, merging as
    llama.cpp does after it unless ``ignore_merges`` says otherwise."""
    from tokenizers import Tokenizer as Inner

    from axtorch.data.tokenizer import Tokenizer
    from axtorch.interop.gguf import IGNORE_MERGES, PRE_TOKENIZERS

    description = tokenizer.description()
    description["model"]["ignore_merges"] = name in IGNORE_MERGES if ignore_merges is None else ignore_merges
    inner = Inner.from_str(json.dumps(description))
    inner.pre_tokenizer = PRE_TOKENIZERS[name]()
    return Tokenizer(inner, tokenizer.eos_token)


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_each_pre_tokenizer_round_trips_and_transformers_splits_text_the_same_way(tmp_path, tokenizer, pre):
    ours = _with_pre_tokenizer(tokenizer, pre)
    to_gguf(_model(tokenizer), ours, tmp_path / "model.gguf", "f32")
    assert GGUFReader(tmp_path / "model.gguf").fields["tokenizer.ggml.pre"].contents() == pre
    back = tokenizer_from_gguf(tmp_path / "model.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf")
    for text in [*TEXTS, "year 2024: 1234567 items, I'M here, you'LL see\r\n\r\n  x"]:
        assert back.encode(text) == ours.encode(text), text
        # transformers' GGUF loader has no entry for smollm and splits as GPT-2 (SmolLM2's own
        # tokenizer.json, which axtorch matches, splits digits off first).
        if pre != "smollm":
            assert theirs(text, add_special_tokens=False).input_ids == ours.encode(text), text
    pieces = [ours.decode([i]) for i in ours.encode("1234567")]
    ends = {sum(len(p) for p in pieces[: i + 1]) for i in range(len(pieces))}
    # Llama 3 splits numbers into runs of three digits; Qwen2 and SmolLM into single digits.
    assert {"llama-bpe": {3, 6}, "qwen2": set(range(1, 8)), "smollm": set(range(1, 8))}.get(pre, set()) <= ends


@pytest.mark.parametrize(("pre", "ignore_merges"), [("llama-bpe", False), ("qwen2", True)])
def test_a_tokenizer_that_merges_otherwise_than_llama_cpp_would_is_refused(tmp_path, tokenizer, pre, ignore_merges):
    # A GGUF has no ignore_merges flag: llama.cpp sets it by the pre-tokenizer's name (Llama 3's).
    ours = _with_pre_tokenizer(tokenizer, pre, ignore_merges=ignore_merges)
    with pytest.raises(ValueError, match=f"ignore_merges={ignore_merges}, but llama.cpp applies ignore_merges="):
        to_gguf(_model(tokenizer), ours, tmp_path / "model.gguf", "f32")
    assert not (tmp_path / "model.gguf").exists()


def test_a_qwen3_model_exports_as_the_qwen3_architecture(tmp_path, tokenizer):
    # head_dim 128: transformers' GGUF loader does not read qwen3.attention.key_length and assumes it.
    model = _model(tokenizer, "model=qwen3_tiny", "model.decoder.layer.attention.head_dim=128")
    to_gguf(model, tokenizer, tmp_path / "qwen3.gguf", "f32")
    assert GGUFReader(tmp_path / "qwen3.gguf").fields["general.architecture"].contents() == "qwen3"
    ids = torch.tensor([tokenizer.encode(" ".join(TEXTS))])
    expected = model(CausalLMInput(ids)).logits
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="qwen3.gguf", dtype=torch.float32)
    ours = from_gguf(tmp_path / "qwen3.gguf")[0]
    assert _relative(theirs(ids).logits, expected) < 1e-6
    assert _relative(ours(CausalLMInput(ids)).logits, expected) < 1e-6


def test_llama_3_rope_scaling_exports_as_llama_cpps_rope_factors_and_reads_back(tmp_path, tokenizer):
    model = _model(tokenizer, "model/position=rope_llama3", "model.decoder.layer.attention.position.theta=500000")
    to_gguf(model, tokenizer, tmp_path / "llama3.gguf", "f32")
    reader = GGUFReader(tmp_path / "llama3.gguf")
    assert "rope_freqs.weight" in {tensor.name for tensor in reader.tensors}
    back, config, _ = from_gguf(tmp_path / "llama3.gguf")
    assert config.decoder.layer.attention.position == model.config.decoder.layer.attention.position
    ids = torch.tensor([tokenizer.encode(" ".join(TEXTS))])
    positions = torch.arange(ids.shape[1])[None] * 700  # far enough for every band of the schedule
    expected = model(CausalLMInput(ids, positions)).logits
    assert _relative(back(CausalLMInput(ids, positions)).logits, expected) < 1e-6
    unreleased = _model(tokenizer, "model/position=rope_llama3", "model.decoder.layer.attention.position.factor=3.0")
    unreleased.config.decoder.layer.attention.position.high_freq_factor = 2.0
    with pytest.raises(ValueError, match="Llama 3's released settings only"):
        to_gguf(unreleased, tokenizer, tmp_path / "other.gguf")
