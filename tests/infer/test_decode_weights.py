"""CPU decode weight formats (``cpu_weights.decode_weights``): stacked q/k/v and gate/up, with
each kernel (torch's linear, torch's matmul on [in, out] copies, oneDNN's packed, axtorch's own), give the plain
modules' logits and tokens and leave the model as it was; the kernel is timed once per thread count;
a linear holding an adapter is left alone."""

import time

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
)
from axtorch.layers.attention import project_separately
from axtorch.layers.feed_forward import project_gate_up
from axtorch.layers.linear import Linear
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
    """Which kernel ``decode_weights`` takes when the caller names none, whatever the rule picks here."""
    if request.param not in cpu_weights.available_kernels():
        pytest.skip(f"this machine has no {request.param.value} kernel")
    monkeypatch.setattr(cpu_weights, "default_kernel", lambda: request.param)
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
        assert isinstance(attention.o_proj, NativeLinear) == (kernel in cpu_weights.NATIVE)
        copies = (PackedLinear, TransposedLinear, NativeLinear)
        assert isinstance(model.lm_head, copies) == (kernel is not DecodeKernel.linear)
        assert isinstance(attention.qkv_projection.product, PackedLinear) == packed
        assert isinstance(attention.qkv_projection.product, NativeLinear) == (kernel in cpu_weights.NATIVE)
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


def test_the_kernel_is_a_rule_never_a_timing_so_a_prompt_decodes_alike_on_every_run(monkeypatch):
    """axtorch's own kernel where it compiled, else torch's linear; no clock is read while decoding."""
    model = _model(MODELS["dense"])
    first = generate_ids(model, PROMPTS, 8)

    def no_clock() -> float:
        raise AssertionError("decoding read a clock")

    monkeypatch.setattr(time, "perf_counter", no_clock)
    monkeypatch.setattr(time, "monotonic", no_clock)
    assert generate_ids(model, PROMPTS, 8) == first
    with cpu_weights.decode_weights(model):
        assert isinstance(model.lm_head, NativeLinear) == (cpu_weights.load_matvec() is not None)
    monkeypatch.setattr(cpu_weights, "load_matvec", lambda: None)  # a machine where it did not compile
    copies = (NativeLinear, PackedLinear, TransposedLinear)
    with cpu_weights.decode_weights(model):
        assert type(model.lm_head) is Linear and not any(isinstance(m, copies) for m in model.modules())


def test_a_named_kernel_is_used_and_one_this_machine_lacks_is_refused_by_name(monkeypatch):
    model = _model(MODELS["dense"])
    assert generate_ids(model, PROMPTS, 6, kernel=DecodeKernel.transposed) == generate_ids(
        model, PROMPTS, 6, pack=False
    )
    monkeypatch.setattr(cpu_weights, "available_kernels", lambda: [DecodeKernel.linear])
    with pytest.raises(ValueError, match="'packed' is not available on this machine; available: \\['linear'\\]"):
        generate_ids(model, PROMPTS, 2, kernel=DecodeKernel.packed)
    with pytest.raises(ValueError, match="compiled decode step multiplies with torch's linear, not transposed"):
        generate_ids(model, PROMPTS, 2, kernel=DecodeKernel.transposed, compile=True)


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
