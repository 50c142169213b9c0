"""axtorch's Llama equals HF transformers' LlamaForCausalLM, logits and gradients, in float64."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from axtorch.interop.hf_llama import hf_to_axtorch_name, hf_to_axtorch_state_dict, llama_config_from_hf
from axtorch.models import CausalLMInput


pytestmark = pytest.mark.usefixtures("float64_hf_rmsnorm")


def _hf_model(tie: bool, attention_bias: bool = False):
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, rope_theta=5000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, attention_bias=attention_bias, max_position_embeddings=128,
    )
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).double().eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb so they are tested
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return config, model


def _ours(hf_config, hf_model):
    config = llama_config_from_hf(hf_config)
    model = config.build().double().eval()
    state = hf_to_axtorch_state_dict(hf_model.state_dict(), config.tie_embeddings)
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("attention_bias", [False, True])
def test_logits_and_gradients_match_hf_llama(tie, attention_bias):
    hf_config, hf_model = _hf_model(tie, attention_bias)
    ours = _ours(hf_config, hf_model)
    ids = torch.randint(0, hf_config.vocab_size, (2, 23))
    weights = torch.randn(2, 23, hf_config.vocab_size, dtype=torch.float64)

    hf_logits = hf_model(input_ids=ids).logits
    our_logits = ours(CausalLMInput(input_ids=ids)).logits
    torch.testing.assert_close(our_logits, hf_logits, rtol=1e-10, atol=1e-10)

    (hf_logits * weights).sum().backward()
    (our_logits * weights).sum().backward()
    our_grads = {name: p.grad for name, p in ours.named_parameters()}
    for name, param in hf_model.named_parameters():
        if tie and name == "lm_head.weight":
            continue
        torch.testing.assert_close(our_grads[hf_to_axtorch_name(name)], param.grad, rtol=1e-9, atol=1e-10, msg=name)


def test_kv_cache_decoding_matches_full_forward():
    hf_config, hf_model = _hf_model(tie=False)
    ours = _ours(hf_config, hf_model)
    ids = torch.randint(0, hf_config.vocab_size, (2, 12))
    full = ours(CausalLMInput(input_ids=ids)).logits
    caches = ours.allocate_kv_caches(2, 16, dtype=torch.float64, device=torch.device("cpu"))
    prefix = ours(CausalLMInput(input_ids=ids[:, :7], kv_caches=caches)).logits
    steps = [prefix]
    for t in range(7, 12):
        positions = torch.full((2, 1), t)
        steps.append(ours(CausalLMInput(input_ids=ids[:, t : t + 1], positions=positions, kv_caches=caches)).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
