"""CPU decode weight formats (``cpu_weights.decode_weights``): stacked q/k/v and gate/up, with
each kernel (torch's linear, torch's matmul on [in, out] copies, oneDNN's packed, axtorch's own), give the plain
modules' logits and tokens and leave the model as it was; the kernel is timed once per thread count;
a linear holding an adapter is left alone."""

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.infer import cpu_weights, decode_weights, generate_ids
from axtorch.infer.cpu_weights import (
    DecodeKernel,
    NativeLinear,
    PackedLinear,
    StackedProjection,
    TransposedLinear,
    fastest_kernel,
)
from axtorch.layers.attention import project_separately
from axtorch.layers.feed_forward import project_gate_up
from axtorch.layers.norm import RMSNormConfig
from axtorch.models import CausalLMInput
from axtorch.models.lora import LoRA, LoRAConfig
from axtorch.train.trainer import build_model

MODELS = {
    "dense": ["experiment=debug"],
    "biased untied": [
        "experiment=debug",
        "model.decoder.layer.attention.qkv_projection.bias=true",
        "model.tie_embeddings=false",
    ],
    "moe": ["experiment=debug", "model=mixtral_tiny"],
}
PROMPTS = [[5, 17, 300, 2], [9, 4]]


def _model(overrides):
    torch.manual_seed(0)
    model = build_model(load_experiment_config(overrides), torch.device("cpu")).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_()  # zero-initialised: a lost bias would not show
    return model


@pytest.fixture(params=list(DecodeKernel), ids=[kernel.value for kernel in DecodeKernel])
def kernel(request, monkeypatch):
    """Which kernel ``decode_weights`` takes, whatever the timing on this machine."""
    if request.param not in cpu_weights.available_kernels():
        pytest.skip(f"this machine has no {request.param.value} kernel")
    monkeypatch.setattr(cpu_weights, "fastest_kernel", lambda weights: request.param)
    return request.param


@pytest.mark.parametrize("kind", list(MODELS))
def test_decode_weights_give_the_plain_modules_logits_and_tokens_and_give_the_model_back(kind, kernel):
    model = _model(MODELS[kind])
    tokens = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(2))
    expected = model(CausalLMInput(input_ids=tokens)).logits
    greedy = generate_ids(model, PROMPTS, 10, pack=False)
    modules = dict(model.named_modules())
    with decode_weights(model):
        attention, feed_forward = model.decoder.layers[0].attention, model.decoder.layers[0].feed_forward
        assert isinstance(attention.qkv_projection, StackedProjection)
        assert (kind == "moe") != isinstance(getattr(feed_forward, "gate_up_projection", None), StackedProjection)
        packed = kernel is DecodeKernel.packed
        assert isinstance(attention.o_proj, PackedLinear) == packed
        assert isinstance(attention.o_proj, TransposedLinear) == (kernel is DecodeKernel.transposed)
        assert isinstance(attention.o_proj, NativeLinear) == (kernel is DecodeKernel.native)
        copies = (PackedLinear, TransposedLinear, NativeLinear)
        assert isinstance(model.lm_head, copies) == (kernel is not DecodeKernel.linear)
        assert isinstance(attention.qkv_projection.product, PackedLinear) == packed
        assert isinstance(attention.qkv_projection.product, NativeLinear) == (kernel is DecodeKernel.native)
        got = model(CausalLMInput(input_ids=tokens)).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert generate_ids(model, PROMPTS, 10) == greedy
    assert dict(model.named_modules()) == modules
    assert model.decoder.layers[0].attention.qkv_projection is project_separately
    if kind != "moe":
        assert model.decoder.layers[0].feed_forward.gate_up_projection is project_gate_up


def test_a_projection_holding_an_adapter_is_not_stacked_and_keeps_its_output():
    model = _model(MODELS["dense"])
    attention = model.decoder.layers[0].attention
    attention.v_proj.adapter = LoRA(LoRAConfig(rank=2), attention.v_proj.in_features, attention.v_proj.out_features)
    with torch.no_grad():
        attention.v_proj.adapter.lora_a.normal_()
        attention.v_proj.adapter.lora_b.normal_()
    tokens = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(3))
    expected = model(CausalLMInput(input_ids=tokens)).logits
    with decode_weights(model):
        assert attention.qkv_projection is project_separately
        assert isinstance(model.decoder.layers[1].attention.qkv_projection, StackedProjection)
        torch.testing.assert_close(model(CausalLMInput(input_ids=tokens)).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 7, 192), (1, 33, 1000)])
def test_the_float32_inference_rms_norm_is_bit_for_bit_the_training_one(shape):
    norm = RMSNormConfig(eps=1e-5).build(shape[-1])
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4)) * 7
    with torch.no_grad():
        inference = norm(x)  # torch.rms_norm, one call
    training = norm(x.requires_grad_())  # the steps written out, differentiable
    torch.testing.assert_close(inference, training.detach(), atol=0, rtol=0)


def test_the_kernel_is_timed_once_per_thread_count_and_the_fastest_kept(monkeypatch):
    monkeypatch.setattr(cpu_weights, "_FASTEST_KERNEL", {})
    timings = []
    time_decode_steps = cpu_weights.time_decode_steps
    monkeypatch.setattr(cpu_weights, "time_decode_steps", lambda model: timings.append(1) or time_decode_steps(model))
    model = _model(MODELS["dense"])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 1, 2):
            torch.set_num_threads(threads)
            assert isinstance(fastest_kernel(model), DecodeKernel)
    finally:
        torch.set_num_threads(before)
    assert len(timings) == 2  # each thread count timed once, its answer kept
    assert set(cpu_weights._FASTEST_KERNEL) == {1, 2}
    seconds = {DecodeKernel.linear: 3.0, DecodeKernel.transposed: 1.0, DecodeKernel.packed: 2.0}
    monkeypatch.setattr(cpu_weights, "_FASTEST_KERNEL", {})
    monkeypatch.setattr(cpu_weights, "time_decode_steps", lambda model: seconds)
    assert fastest_kernel(model) is DecodeKernel.transposed


def test_every_kernel_is_timed_on_a_whole_decode_step_in_its_formats(monkeypatch):
    model = _model(MODELS["dense"])
    modules = dict(model.named_modules())
    entered = []
    decode_weights = cpu_weights.decode_weights
    monkeypatch.setattr(
        cpu_weights, "decode_weights", lambda m, kernel: entered.append(kernel) or decode_weights(m, kernel)
    )
    seconds = cpu_weights.time_decode_steps(model, trials=2)
    assert entered == cpu_weights.available_kernels() == list(seconds)
    assert all(0 < s < 1 for s in seconds.values())
    assert dict(model.named_modules()) == modules


def test_every_kernel_is_timed_on_every_weight_with_its_copies_made_once(monkeypatch):
    made, calls = [], []
    for module in (PackedLinear, TransposedLinear):
        init, forward = module.__init__, module.forward
        monkeypatch.setattr(module, "__init__", lambda self, w, b, i=init, m=module: made.append(m) or i(self, w, b))
        monkeypatch.setattr(module, "forward", lambda self, x, f=forward, m=module: calls.append(m) or f(self, x))
    weights = [torch.randn(64, 32), torch.randn(96, 32)]
    seconds = cpu_weights.time_kernels(weights, trials=3)
    assert set(seconds) == set(cpu_weights.available_kernels()) and all(0 < s < 1 for s in seconds.values())
    assert made == [TransposedLinear] * 2 + [PackedLinear] * 2  # one copy a weight, each kernel's in turn
    assert calls == [TransposedLinear] * 6 + [PackedLinear] * 6  # each product once a trial
