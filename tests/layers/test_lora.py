"""LoRA (``model/adapter=lora``): peft's LoRA on transformers' Llama, step for step, in float64.

The same random HF Llama in both, the same initial adapters (B non-zero, so that A's gradients
are tested from the first step), the same AdamW: the losses and every adapter gradient agree
over a few steps, and the base stays frozen. Then merging folds an adapter into its linear's
weight without changing the model's function, and a target that names no linear is refused.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import torch.nn.functional as F
from hf_shapes import HF_SHAPE

from axtorch.config.errors import ConfigError
from axtorch.interop.families import config_from_hf
from axtorch.interop.families.llama_layout import hf_to_axtorch_name, hf_to_axtorch_state_dict
from axtorch.models import CausalLMInput
from axtorch.models.adapter import adapted_linears, merge_adapters
from axtorch.models.lora import LoRAConfig

pytestmark = pytest.mark.usefixtures("float64_hf_rmsnorm")

SEQ_LEN = 17
STEPS = 3


def _hf_and_ours(random_hf_model, lora: LoRAConfig):
    """A random float64 HF Llama, and ours with the same weights and ``lora``'s adapters."""
    hf_config = transformers.LlamaConfig(**HF_SHAPE, rope_theta=5000.0, rms_norm_eps=1e-5)
    hf_model = random_hf_model(hf_config)
    config = config_from_hf(hf_config)
    ours = config.build().double()
    ours.load_state_dict(hf_to_axtorch_state_dict(hf_model.state_dict(), config.tie_embeddings), strict=True)
    lora.build(torch.device("cpu")).apply(ours)
    return hf_model, ours.double()


def _ours_and_peft(random_hf_model, lora: LoRAConfig, targets: list[str], monkeypatch):
    hf_model, ours = _hf_and_ours(random_hf_model, lora)
    # peft asks for torchao >= 0.16 as soon as torchao is installed, to wrap torchao-quantized
    # layers; torch 2.9 needs torchao 0.14, and these layers are plain.
    monkeypatch.setattr(peft.tuners.lora.torchao, "is_torchao_available", lambda: False)
    theirs = peft.get_peft_model(
        hf_model,
        peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets),
    ).double()
    return ours, theirs


def _pairs(ours, theirs) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter, str]]:
    """(our adapter parameter, peft's, our name) for every adapter matrix."""
    our_params = dict(ours.named_parameters())
    pairs = []
    for name, param in theirs.named_parameters():
        if "lora_" not in name:
            continue
        module, matrix = name.removeprefix("base_model.model.").split(".lora_")
        ours_module = hf_to_axtorch_name(f"{module}.weight").removesuffix(".weight")
        ours_name = f"{ours_module}.adapter.lora_{matrix[0].lower()}"
        pairs.append((our_params[ours_name], param, ours_name))
    return pairs


def test_losses_and_adapter_gradients_match_peft(random_hf_model, monkeypatch):
    ours, theirs = _ours_and_peft(random_hf_model, LoRAConfig(rank=4, alpha=8.0), ["q_proj", "v_proj"], monkeypatch)
    pairs = _pairs(ours, theirs)
    trainable = sorted(name for name, p in ours.named_parameters() if p.requires_grad)
    assert trainable == sorted(name for _, _, name in pairs)
    assert len(pairs) == 2 * 2 * HF_SHAPE["num_hidden_layers"]  # q and v, A and B, per layer
    torch.manual_seed(1)
    with torch.no_grad():  # the same initial adapters, B non-zero so that every gradient is exercised
        for mine, their, _ in pairs:
            mine.copy_(torch.randn_like(mine) * 0.1)
            their.copy_(mine)
    ours_optimizer = torch.optim.AdamW([p for p, _, _ in pairs], lr=1e-2, weight_decay=0.1)
    peft_optimizer = torch.optim.AdamW([p for _, p, _ in pairs], lr=1e-2, weight_decay=0.1)
    frozen_before = {n: p.clone() for n, p in ours.named_parameters() if not p.requires_grad}
    losses = []
    ids = torch.randint(0, HF_SHAPE["vocab_size"], (2, SEQ_LEN + 1))
    for _ in range(STEPS):
        logits = ours(CausalLMInput(input_ids=ids[:, :-1])).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        peft_loss = F.cross_entropy(theirs(input_ids=ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten())
        torch.testing.assert_close(loss, peft_loss, rtol=1e-12, atol=1e-12)
        loss.backward()
        peft_loss.backward()
        for mine, their, name in pairs:
            torch.testing.assert_close(mine.grad, their.grad, rtol=1e-9, atol=1e-12, msg=name)
        ours_optimizer.step()
        peft_optimizer.step()
        ours_optimizer.zero_grad()
        peft_optimizer.zero_grad()
        losses.append(loss.item())
    print(f"losses over {STEPS} steps, equal to peft's: {losses}")
    assert losses[-1] < losses[0] - 0.05  # the adapters learn the batch
    for name, value in frozen_before.items():
        assert torch.equal(ours.get_parameter(name), value), name
        assert ours.get_parameter(name).grad is None, name


def test_merging_keeps_the_function_and_removes_the_adapters(random_hf_model):
    _, ours = _hf_and_ours(random_hf_model, LoRAConfig(rank=2, alpha=3.0, target=r"(q|o|down)_proj|lm_head"))
    with torch.no_grad():
        for _, linear in adapted_linears(ours):
            linear.adapter.lora_b.normal_()
    ids = torch.randint(0, HF_SHAPE["vocab_size"], (2, SEQ_LEN))
    with torch.no_grad():
        adapted = ours(CausalLMInput(input_ids=ids)).logits
        assert len(merge_adapters(ours)) == 3 * HF_SHAPE["num_hidden_layers"] + 1
        merged = ours(CausalLMInput(input_ids=ids)).logits
    assert not adapted_linears(ours)
    assert not any(".adapter." in name for name in ours.state_dict())
    torch.testing.assert_close(merged, adapted, rtol=1e-10, atol=1e-10)


def test_a_target_that_names_no_linear_is_refused(random_hf_model):
    with pytest.raises(ConfigError, match=r"model\.adapter\.target.*q_proj"):
        _hf_and_ours(random_hf_model, LoRAConfig(target=r"self_attn\.q_proj"))
    with pytest.raises(ConfigError, match=r"model\.adapter\.rank"):
        LoRAConfig(rank=0).validate()
