"""Generation with the training modules: cached decoding equals full forwards, batches equal rows
alone, rows stop on their own, sampling rules, greedy parity with transformers, and the CLI."""

import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.data.tokenizer import train_byte_level_bpe
from axtorch.infer import SamplingConfig, cpu_weights, generate, generate_ids, pack_linears, quantize_int8
from axtorch.infer.cpu_weights import PackedLinear
from axtorch.infer.sampling import apply_penalties, sample_next_token
from axtorch.interop.families import config_from_hf
from axtorch.interop.families.llama_layout import hf_to_axtorch_state_dict
from axtorch.layers.linear import Linear
from axtorch.models import CausalLMInput
from axtorch.train.trainer import Trainer, build_model

MODELS = {
    "dense": ["experiment=debug"],
    "sliding_window": ["experiment=debug", "model=mistral_tiny", "model.decoder.layer.attention.mask.window=5"],
    "moe": ["experiment=debug", "model=mixtral_tiny"],
    "alibi": ["experiment=debug", "model/position=alibi"],
}


def _model(overrides):
    torch.manual_seed(0)
    return build_model(load_experiment_config(overrides), torch.device("cpu")).eval()


@torch.no_grad()
def _decoded_logits(model, tokens, caches, prefill=6):
    """Logits of a prefill of ``prefill`` tokens, then of one token per call, through ``caches``."""
    logits = [model(CausalLMInput(input_ids=tokens[:, :prefill], kv_caches=caches)).logits]
    for i in range(prefill, tokens.shape[1]):
        step = CausalLMInput(input_ids=tokens[:, i : i + 1], positions=torch.full((2, 1), i), kv_caches=caches)
        logits.append(model(step).logits)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("kind", list(MODELS))
def test_cached_decoding_gives_the_logits_of_a_full_forward(kind):
    model = _model(MODELS[kind])
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    full = model(CausalLMInput(input_ids=tokens)).logits
    caches = model.allocate_kv_caches(2, 16, dtype=torch.float32, device=torch.device("cpu"))
    torch.testing.assert_close(_decoded_logits(model, tokens, caches), full, atol=2e-5, rtol=1e-4)


def test_a_sliding_window_layer_decodes_from_a_ring_of_its_window_with_the_logits_of_a_full_forward():
    model = _model(MODELS["sliding_window"])  # window 5
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    full = model(CausalLMInput(input_ids=tokens)).logits
    caches = model.allocate_kv_caches(2, 16, dtype=torch.float32, device=torch.device("cpu"), max_write=6)
    assert {cache.max_len for cache in caches} == {5 + 6 - 1}  # not 16: the ring wraps below
    torch.testing.assert_close(_decoded_logits(model, tokens, caches), full, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="ring KV cache of 10 slots for window 5 takes at most 6 tokens"):
        model(CausalLMInput(input_ids=tokens[:, :7], kv_caches=caches))


@pytest.mark.parametrize("tied", [False, True])
def test_head_positions_project_only_those_positions_with_the_full_forwards_logits(tied):
    model = _model(["experiment=debug", f"model.tie_embeddings={str(tied).lower()}"])
    tokens = torch.randint(0, 500, (3, 9), generator=torch.Generator().manual_seed(2))
    wanted = torch.tensor([[8], [0], [4]])  # each row's last prompt token, as a prefill asks
    with torch.no_grad():
        full = model(CausalLMInput(input_ids=tokens)).logits
        some = model(CausalLMInput(input_ids=tokens, head_positions=wanted)).logits
    assert some.shape == (3, 1, model.config.vocab_size)
    torch.testing.assert_close(some, full[torch.arange(3)[:, None], wanted], atol=1e-6, rtol=1e-5)


PROMPTS = [[5, 17, 3, 99, 4, 8, 21], [7], [42, 43, 44, 45]]


@pytest.mark.parametrize("kind", ["dense", "sliding_window", "moe"])
def test_a_batch_of_prompts_of_different_lengths_decodes_as_each_prompt_alone(kind):
    model = _model(MODELS[kind])
    batched = generate_ids(model, PROMPTS, 12)
    alone = [generate_ids(model, [prompt], 12)[0] for prompt in PROMPTS]
    assert batched == alone
    assert all(len(row) == 12 for row in batched)


def test_seeded_sampling_is_reproducible_per_row_whatever_the_batch():
    model = _model(MODELS["dense"])
    sampling = SamplingConfig(temperature=1.0, top_k=50, top_p=0.95, repetition_penalty=1.2)
    batched = generate_ids(model, PROMPTS, 10, sampling, seeds=[11, 12, 13])
    alone = [generate_ids(model, [p], 10, sampling, seeds=[seed])[0] for p, seed in zip(PROMPTS, [11, 12, 13])]
    assert batched == alone
    assert generate_ids(model, PROMPTS, 10, sampling, seeds=[11, 12, 14])[:2] == batched[:2]
    assert generate_ids(model, PROMPTS, 10, sampling, seeds=[99, 12, 13])[0] != batched[0]


@pytest.mark.slow
@pytest.mark.journey  # inductor starts Python processes (its compile workers, its library check)
def test_a_compiled_decode_step_gives_the_eager_tokens_and_compiles_once_per_length_bucket():
    model = _model(MODELS["dense"])
    sampling = SamplingConfig(temperature=0.8, top_k=40)
    eager = generate_ids(model, PROMPTS, 8, sampling, seeds=[1, 2, 3])
    torch._dynamo.reset()
    counters["stats"].clear()
    assert generate_ids(model, PROMPTS, 8, sampling, seeds=[1, 2, 3], compile=True) == eager
    # Another length in the same bucket of cache slots reuses the program: no step recompiles
    # (a step that did, e.g. on a guard naming a tensor that lives one step, would count here).
    assert generate_ids(model, PROMPTS, 5, sampling, seeds=[1, 2, 3], compile=True) == [row[:5] for row in eager]
    assert counters["stats"]["unique_graphs"] == 1


def test_greedy_decoding_equals_a_full_forward_per_token():
    model = _model(MODELS["dense"])
    prompt = [5, 17, 3, 99]
    generated = generate_ids(model, [prompt], 12)[0]
    ids = list(prompt)
    for _ in range(12):
        ids.append(int(model(CausalLMInput(input_ids=torch.tensor([ids]))).logits[0, -1].argmax()))
    assert generated == ids[len(prompt) :]


def test_each_row_stops_at_its_own_stop_token():
    model = _model(MODELS["dense"])
    free = generate_ids(model, PROMPTS, 12)
    stop = free[1][4]  # row 1's fifth token
    stopped = generate_ids(model, PROMPTS, 12, stop_token_ids=[stop])
    for row, tokens in zip(free, stopped):
        assert tokens == row[: row.index(stop)] if stop in row else tokens == row


@pytest.fixture(scope="module")
def tokenizer():
    text = "def main():\n    return 0\n" * 50 + "the quick brown fox jumps over the lazy dog\n" * 50
    return train_byte_level_bpe(iter([text]), 300, "<|endoftext|>")


def test_stop_strings_cut_the_text_and_streaming_delivers_it_exactly(tokenizer):
    model = _model([*MODELS["dense"], f"model.vocab_size={tokenizer.vocab_size}"])
    prompts = ["def main", "the quick"]
    free = generate(model, tokenizer, prompts, max_new_tokens=16, sync_every=3)
    assert [g.finish_reason for g in free] == ["length", "length"]
    stop = free[0].text[6:9]
    streamed = ["", ""]

    def stream(row, text):
        streamed[row] += text

    cut = generate(model, tokenizer, prompts, max_new_tokens=16, stop=[stop], stream=stream, sync_every=3)
    assert cut[0].text == free[0].text[: free[0].text.index(stop)] and cut[0].finish_reason == "stop"
    assert tokenizer.decode(cut[0].token_ids).startswith(cut[0].text)
    assert streamed == [g.text for g in cut]


def test_greedy_generation_equals_transformers_generate():
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    ours = config_from_hf(hf_config).build()
    ours.load_state_dict(hf_to_axtorch_state_dict(hf_model.state_dict(), tie_embeddings=False))
    ours.eval()
    ids = generate_ids(ours, PROMPTS, 10)
    for prompt, row in zip(PROMPTS, ids):
        expected = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert row == expected


def test_int8_weights_keep_the_logits_close_and_decode():
    model = _model(MODELS["dense"])
    tokens = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(2))
    expected = model(CausalLMInput(input_ids=tokens)).logits
    quantized = quantize_int8(_model(MODELS["dense"]), skip=())
    assert not any(isinstance(m, Linear) for m in quantized.modules())
    got = quantized(CausalLMInput(input_ids=tokens)).logits
    relative = (got - expected).norm() / expected.norm()
    assert relative < 0.05, relative
    assert [len(row) for row in generate_ids(quantized, PROMPTS, 5)] == [5, 5, 5]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_packed_fp32_weights_give_the_logits_and_the_greedy_tokens(kind):
    model = _model(MODELS[kind])
    tokens = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(2))
    expected = model(CausalLMInput(input_ids=tokens)).logits
    greedy = generate_ids(model, PROMPTS, 12, pack=False)
    packed = pack_linears(_model(MODELS[kind]))
    assert not any(isinstance(m, Linear) for m in packed.modules())
    assert isinstance(packed.lm_head, PackedLinear)
    torch.testing.assert_close(packed(CausalLMInput(input_ids=tokens)).logits, expected, atol=1e-5, rtol=1e-5)
    assert generate_ids(packed, PROMPTS, 12) == greedy


@pytest.fixture
def packed_kernel(monkeypatch):
    """oneDNN's packed kernel as the decode kernel, whatever the rule picks here."""
    monkeypatch.setattr(cpu_weights, "default_kernel", lambda: cpu_weights.DecodeKernel.packed)


@pytest.mark.parametrize("tied", [False, True])
def test_a_library_generate_call_on_the_cpu_decodes_through_packed_weights_and_gives_back_the_model(
    tokenizer, tied, monkeypatch, packed_kernel
):
    model = _model([*MODELS["dense"], f"model.vocab_size={tokenizer.vocab_size}", f"model.tie_embeddings={tied}"])
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    modules = dict(model.named_modules())
    packed_calls = []
    forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: packed_calls.append(1) or forward(self, x))
    prompts, sampling = ["def main", "the quick"], SamplingConfig(temperature=0.8)

    unpacked = generate(model, tokenizer, prompts, max_new_tokens=12, sampling=sampling, pack=False)
    assert not packed_calls
    packed = generate(model, tokenizer, prompts, max_new_tokens=12, sampling=sampling)  # the default
    assert len(packed_calls) >= 12 * (len(model.decoder.layers) * 4 + 1)  # qkv stacked, o, gate+up, down, head
    assert packed == unpacked
    assert dict(model.named_modules()) == modules and (model.lm_head is None) == tied  # its own modules back
    torch.testing.assert_close(model.state_dict(), state, atol=0, rtol=0)


def test_packing_after_int8_keeps_the_int8_layers_and_packs_the_rest():
    model = pack_linears(quantize_int8(_model(MODELS["dense"])))
    kinds = {type(m).__name__ for name, m in model.named_modules() if name.endswith("proj") or name == "lm_head"}
    assert {type(model.lm_head).__name__, type(model.decoder.layers[0].feed_forward.up_proj).__name__} == {
        "Int8Linear",
        "PackedLinear",
    }
    assert kinds == {"Int8Linear", "PackedLinear"}


def test_top_k_sampling_only_draws_from_the_k_best():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]])
    generators = [torch.Generator().manual_seed(0)]
    config = SamplingConfig(temperature=2.0, top_k=2)
    assert {int(sample_next_token(logits, config, generators)) for _ in range(200)} == {1, 2}


def test_top_p_keeps_the_token_that_crosses_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generators = [torch.Generator().manual_seed(0)]
    config = SamplingConfig(temperature=1.0, top_p=0.7)
    assert {int(sample_next_token(logits, config, generators)) for _ in range(300)} == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generators = [torch.Generator().manual_seed(0)]
    config = SamplingConfig(temperature=1.0, min_p=0.5)
    assert {int(sample_next_token(logits, config, generators)) for _ in range(300)} == {0, 1}


def test_sampling_draws_tokens_with_their_probabilities():
    probabilities = torch.tensor([0.6, 0.3, 0.1])
    generators = [torch.Generator().manual_seed(0)]
    draws = torch.stack(
        [sample_next_token(probabilities.log()[None], SamplingConfig(temperature=1.0), generators) for _ in range(4000)]
    )
    frequencies = torch.bincount(draws[:, 0], minlength=3) / 4000
    torch.testing.assert_close(frequencies, probabilities, atol=0.03, rtol=0)


def test_penalties_follow_hf_repetition_and_openai_frequency_presence_rules():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    counts = torch.tensor([[0.0, 0.0, 3.0, 0.0]])
    config = SamplingConfig(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    expected = torch.tensor([[1.0, -4.0, 1.0 - 1.5 - 0.25, 0.5]])
    torch.testing.assert_close(apply_penalties(logits, config, seen, counts), expected)
    hf = pytest.importorskip("transformers").RepetitionPenaltyLogitsProcessor(2.0)
    only_repetition = SamplingConfig(repetition_penalty=2.0)
    torch.testing.assert_close(
        apply_penalties(logits, only_repetition, seen, counts), hf(torch.tensor([[0, 1]]), logits.clone())
    )


def test_generation_refuses_to_run_past_the_model_length():
    model = _model(MODELS["dense"])
    with pytest.raises(ValueError, match="max_seq_len=256"):
        generate_ids(model, [[1] * 250], 10)


def _generate_command(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "axtorch.generate", *arguments], capture_output=True, text=True)


@pytest.mark.journey
def test_generate_command_continues_prompts_from_a_trained_run(tmp_path, data_cache):
    config = load_experiment_config(
        [
            "experiment=debug",
            f"run_dir={tmp_path / 'run'}",
            f"data.cache_dir={data_cache}",
            "trainer.max_steps=4",
            "trainer.progress_bar=false",
        ]
    )
    Trainer(config).fit()
    run = f"checkpoint={tmp_path / 'run'}"
    one = _generate_command(run, "prompt=import os", "max_new_tokens=8")
    assert one.returncode == 0, one.stderr[-2000:]
    assert one.stdout.startswith("import os") and len(one.stdout.rstrip("\n")) > len("import os")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\ndef main(\n")
    batch = _generate_command(run, f"prompts_file={prompts}", "max_new_tokens=6", "sampling.temperature=0.8")
    assert batch.returncode == 0, batch.stderr[-2000:]
    assert batch.stdout.count("--- prompt ") == 2 and "\nimport os" in batch.stdout and "\ndef main(" in batch.stdout
    int8 = _generate_command(run, "prompt=import os", "max_new_tokens=4", "quantize=int8")
    assert int8.returncode == 0 and int8.stdout.startswith("import os"), int8.stderr[-2000:]
    misspelt = _generate_command(run, "prompt=x", "sampling.temprature=1")
    assert misspelt.returncode == 2 and "did you mean sampling.temperature" in misspelt.stderr
    no_template = _generate_command(run, "prompt=x", "chat=true")
    assert no_template.returncode == 2 and "has no chat template" in no_template.stderr
    two_sources = _generate_command(run, "gguf=model.gguf", "prompt=x")
    assert two_sources.returncode == 2 and "exactly one of checkpoint=DIR, gguf=FILE or hf=DIR" in two_sources.stderr


def test_library_generate_calls_reuse_the_packed_weights_until_a_weight_changes(monkeypatch, packed_kernel):
    model = _model(MODELS["dense"])
    packings = []
    init = PackedLinear.__init__
    monkeypatch.setattr(PackedLinear, "__init__", lambda self, w, b: packings.append(1) or init(self, w, b))
    first = generate_ids(model, PROMPTS, 6)
    per_call = len(packings)
    assert per_call == len(model.decoder.layers) * 4 + 1  # q+k+v stacked, o, gate+up stacked, down; the head
    assert generate_ids(model, PROMPTS, 6) == first and len(packings) == per_call  # nothing packed again
    with torch.no_grad():
        model.decoder.layers[-1].feed_forward.down_proj.weight.mul_(-50.0)  # in place, as an optimizer step
    changed = generate_ids(model, PROMPTS, 6)
    assert len(packings) == per_call + 1  # that weight alone
    assert changed == generate_ids(model, PROMPTS, 6, pack=False) != first
    with torch.no_grad():
        model.decoder.layers[0].attention.k_proj.weight.mul_(-2.0)
    generate_ids(model, PROMPTS, 6)
    assert len(packings) == per_call + 2  # the stack that holds it


@pytest.mark.parametrize(
    ("setting", "value", "allowed"),
    [
        ("temperature", -0.5, "0 (greedy) or a positive float"),
        ("top_k", 0, "a positive integer or null"),
        ("top_p", 0.0, "a probability in (0, 1] or null"),
        ("top_p", 1.5, "a probability in (0, 1] or null"),
        ("min_p", 1.5, "a fraction in [0, 1] or null"),
        ("repetition_penalty", 0.0, "a positive float (1: off)"),
    ],
)
def test_sampling_settings_out_of_range_are_refused_by_name(setting, value, allowed):
    with pytest.raises(ConfigError) as refusal:
        SamplingConfig(**{setting: value}).validate()
    message = str(refusal.value)
    assert f"sampling.{setting}" in message and str(value) in message and allowed in message, message
