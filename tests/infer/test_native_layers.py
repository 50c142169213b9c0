"""The compiled layer step (``native_layers``): with axtorch's own kernel, decoding one to eight rows
runs each run of recognised layers as one C call and gives the modules' logits and tokens, for every
composition it recognises (pre- and sandwich norms, query/key norms, sliding-window rings,
soft-capping, biases, grouped heads, no rotation) and for rows of different lengths; layers it
does not recognise, larger batches and training mode run the modules."""

import ctypes

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.infer import cpu_weights, decode_weights, generate_ids, native_kernels, native_layers
from axtorch.infer.cpu_weights import DecodeKernel
from axtorch.infer.native_kernels import compiler
from axtorch.infer.native_layers import NativeLayerRunner
from axtorch.layers.transformer import run_layers_unrolled
from axtorch.models import CausalLMInput
from axtorch.models.lora import LoRA, LoRAConfig
from axtorch.train.trainer import build_model
from tests.gguf_blocks import expanded

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler on this machine")

#: Compositions the step recognises in every layer.
RECOGNISED = {
    "llama": ["experiment=debug"],
    "qkv bias, untied, yarn": [
        "experiment=debug",
        "model/position=rope_yarn",
        "model.decoder.layer.attention.position.factor=4",
        "model.decoder.layer.attention.qkv_projection.bias=true",
        "model.decoder.layer.feed_forward.projection.bias=true",
        "model.tie_embeddings=false",
    ],
    # sandwich norms, query/key norms, GELU (tanh), 5 sliding-window layers of 8 to 1 global, two rotary bases
    "gemma 3": ["experiment=debug", "model=gemma3_tiny"],
    "soft-capped, scaled, relu": [
        "experiment=debug",
        "model=gemma3_tiny",
        "model/attention_kernel=softcapped",
        "model.decoder.layer.attention.softmax_scale=0.3",
        "model.decoder.layer.feed_forward.activation=relu",
    ],
    "gelu, no rotation": [
        "experiment=debug",
        "model/position=none",
        "model.decoder.layer.feed_forward.activation=gelu",
    ],
    # grouped heads (6 to 2), a sliding window of 16 in two layers of three
    "local/global": ["experiment=debug", "model=local_global_tiny"],
}
PROMPT = [5, 17, 300, 2, 9, 4]


def _model(overrides):
    torch.manual_seed(0)
    model = build_model(load_experiment_config(overrides), torch.device("cpu")).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                parameter.normal_()  # zero or one at initialisation: a lost bias or norm weight would not show
    return model


@pytest.fixture(autouse=True)
def native_kernel(monkeypatch):
    if DecodeKernel.native not in cpu_weights.available_kernels():
        pytest.skip("the decode kernels did not build here")
    monkeypatch.setattr(cpu_weights, "default_kernel", lambda: DecodeKernel.native)


#: Prompts of a batch, of different lengths (right-padded, as ``generate_ids`` batches them).
BATCH = [PROMPT, [7, 7, 1], [4, 3, 2, 1, 8, 8, 9, 10]]


def _step_logits(model, steps: int, prompts=(PROMPT,)) -> torch.Tensor:
    """The logits of ``steps`` one-token decode steps of every prompt after their prefill, greedy."""
    lengths = [len(prompt) for prompt in prompts]
    caches = model.allocate_kv_caches(
        len(prompts), max(lengths) + steps, dtype=torch.float32, device="cpu", max_write=max(lengths)
    )
    ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
    positions = torch.tensor(lengths)[:, None]
    logits = model(CausalLMInput(input_ids=ids, kv_caches=caches, head_positions=positions - 1)).logits
    every = []
    for _ in range(steps):
        token = logits.argmax(-1)
        logits = model(CausalLMInput(input_ids=token, positions=positions, kv_caches=caches)).logits
        every.append(logits)
        positions = positions + 1
    return torch.cat(every, dim=1)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", list(RECOGNISED))
@torch.no_grad()
def test_every_layer_runs_compiled_and_gives_the_modules_logits_and_tokens(kind, threads, rows):
    model = _model(RECOGNISED[kind])
    prompts = BATCH[:rows]
    steps = 20  # past gemma3_tiny's window of 8: the rings wrap
    expected = _step_logits(model, steps, prompts)
    greedy = generate_ids(model, prompts, steps, pack=False)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with decode_weights(model):
            runner = model.decoder.layer_runner
            assert isinstance(runner, NativeLayerRunner)
            assert all(native is not None for native in runner.layers)
            got = _step_logits(model, steps, prompts)
        tokens = generate_ids(model, prompts, steps)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert tokens == greedy
    assert model.decoder.layer_runner is run_layers_unrolled


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", ["llama", "gemma 3"])
@torch.no_grad()
def test_weights_expanded_from_gguf_blocks_run_as_codes_and_give_the_modules_logits_and_tokens(kind, rows):
    """Every matrix expanded from a 4-bit format but the k projections (8-bit): the q/k/v stacks
    are coded in 8 bits, the rest in 4; the head (tied) stays float32 where its width is no multiple of 32."""
    if not native_kernels.reads_codes():
        pytest.skip("decoding keeps float32 weights here (kernels built for neither AVX2 nor AVX-512)")
    model = _model(RECOGNISED[kind])
    for name, parameter in model.named_parameters():
        if parameter.dim() == 2 and parameter.shape[1] % 32 == 0 and "embedding" not in name:
            parameter.copy_(expanded(parameter, "Q8_0" if "k_proj" in name else "Q4_1"))
    prompts = BATCH[:rows]
    expected = _step_logits(model, 12, prompts)
    greedy = generate_ids(model, prompts, 12, pack=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with decode_weights(model):
            runner = model.decoder.layer_runner
            assert isinstance(runner, NativeLayerRunner)
            for native in runner.layers:
                named = dict(zip(native_layers.WEIGHTS, native.weights))
                bits = [native_kernels.code_bits(named[m], named[f"{m}_codes"]) for m in native_layers.MATRICES]
                assert bits == [8, 4, 4, 4]
            got = _step_logits(model, 12, prompts)
        tokens = generate_ids(model, prompts, 12)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert tokens == greedy


@torch.no_grad()
def test_a_layer_it_does_not_recognise_runs_its_modules_among_compiled_ones():
    model = _model(["experiment=debug"])
    attention = model.decoder.layers[1].attention
    attention.q_proj.adapter = LoRA(LoRAConfig(rank=2), attention.q_proj.in_features, attention.q_proj.out_features)
    attention.q_proj.adapter.lora_a.normal_()
    attention.q_proj.adapter.lora_b.normal_()  # zero at initialisation: it would change nothing
    expected = _step_logits(model, 6)
    with decode_weights(model):
        runner = model.decoder.layer_runner
        assert isinstance(runner, NativeLayerRunner)
        assert [native is None for native in runner.layers] == [i == 1 for i in range(len(runner.layers))]
        got = _step_logits(model, 6)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_model_without_a_recognised_layer_keeps_the_default_runner():
    model = _model(["experiment=debug", "model=mixtral_tiny"])
    with decode_weights(model):
        assert model.decoder.layer_runner is run_layers_unrolled


def test_more_rows_than_a_step_takes_and_training_mode_run_the_modules(monkeypatch):
    model = _model(["experiment=debug", "model=gemma3_tiny"])
    prompts = [PROMPT, [7, 7, 1]] * 5  # 10 rows: above MAX_ROWS
    greedy = generate_ids(model, prompts, 12, pack=False)
    with decode_weights(model):
        runner = model.decoder.layer_runner
        assert isinstance(runner, NativeLayerRunner)
        compiled = []
        monkeypatch.setattr(runner, "run_steps", lambda *arguments: compiled.append(arguments))
        assert generate_ids(model, prompts, 12) == greedy
        with torch.no_grad():
            model.train()  # dropout, were any configured: the modules apply it
            _step_logits(model, 2)
    assert compiled == []


@torch.no_grad()
def test_a_position_past_the_cache_is_refused_before_any_write():
    model = _model(["experiment=debug"])
    caches = model.allocate_kv_caches(1, 4, dtype=torch.float32, device="cpu")
    with decode_weights(model), pytest.raises(ValueError, match="position 4 is past the KV cache's 4 slots"):
        model(CausalLMInput(input_ids=torch.tensor([[3]]), positions=torch.tensor([[4]]), kv_caches=caches))
    assert all(not cache.keys.any() for cache in caches)


@torch.no_grad()
def test_a_build_without_openmp_runs_the_same_steps_on_one_thread(tmp_path, monkeypatch):
    """A compiler without OpenMP builds the same sources; their parallel regions run on the caller's thread."""
    monkeypatch.setattr(native_kernels, "OPENMP", ())
    built = native_kernels._build(compiler(), tmp_path)
    assert built is not None
    monkeypatch.setattr(native_layers, "load_library", lambda: ctypes.CDLL(str(built)))
    model = _model(RECOGNISED["gemma 3"])
    expected = _step_logits(model, 12)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with decode_weights(model):
            assert isinstance(model.decoder.layer_runner, NativeLayerRunner)
            got = _step_logits(model, 12)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
