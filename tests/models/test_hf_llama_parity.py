"""axtorch equals HF transformers' Llama-family models, logits and gradients, in float64.

Llama itself (with and without biases and tied embeddings), its RoPE scaling variants (Llama 3.1,
linear, YaRN), Mistral's sliding window (narrower than the sequence) and Qwen3's QK-norm with an
explicit head_dim.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_shapes import HF_SHAPE

from axtorch.interop.families import config_from_hf
from axtorch.interop.families.llama_layout import hf_to_axtorch_name, hf_to_axtorch_state_dict
from axtorch.layers.attention_mask import CausalMaskConfig
from axtorch.layers.relative_position import RotaryEmbeddingConfig
from axtorch.models import CausalLMInput

pytestmark = pytest.mark.usefixtures("float64_hf_rmsnorm")

SHAPE = {**HF_SHAPE, "num_hidden_layers": 3, "rms_norm_eps": 1e-5}
SEQ_LEN = 23

#: case -> (HF config class, fields beyond SHAPE). An original context of 16 makes the Llama 3.1 RoPE
#: scaling act within SEQ_LEN positions; a window of 5 is narrower than the sequence.
FAMILIES = {
    "llama3-rope": (
        transformers.LlamaConfig,
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=5000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
    ),
    "linear-rope": (
        transformers.LlamaConfig,
        dict(rope_parameters=dict(rope_type="linear", rope_theta=5000.0, factor=4.0)),
    ),
    "yarn-rope": (
        transformers.LlamaConfig,
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=5000.0,
                factor=4.0,
                original_max_position_embeddings=32,
            )
        ),
    ),
    "mistral-window": (transformers.MistralConfig, dict(rope_theta=5000.0, sliding_window=5)),
    "qwen3": (transformers.Qwen3Config, dict(rope_theta=5000.0, head_dim=16, tie_word_embeddings=True)),
    "qwen3-window": (
        transformers.Qwen3Config,
        dict(
            rope_theta=5000.0,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=0,
        ),
    ),
}


def _llama_config(tie: bool, attention_bias: bool = False):
    return transformers.LlamaConfig(
        **SHAPE,
        rope_theta=5000.0,
        tie_word_embeddings=tie,
        attention_bias=attention_bias,
    )


def _family_config(case: str):
    config_class, fields = FAMILIES[case]
    return config_class(**SHAPE, **fields)


def _ours(hf_config, hf_model):
    config = config_from_hf(hf_config)
    model = config.build().double().eval()
    state = hf_to_axtorch_state_dict(hf_model.state_dict(), config.tie_embeddings)
    model.load_state_dict(state, strict=True)
    return model


def _assert_logits_and_gradients_match(hf_config, hf_model, ours):
    ids = torch.randint(0, hf_config.vocab_size, (2, SEQ_LEN))
    weights = torch.randn(2, SEQ_LEN, hf_config.vocab_size, dtype=torch.float64)

    hf_logits = hf_model(input_ids=ids).logits
    our_logits = ours(CausalLMInput(input_ids=ids)).logits
    print(f"max |logits difference| {(our_logits - hf_logits).abs().max().item():.3g}")
    torch.testing.assert_close(our_logits, hf_logits, rtol=1e-10, atol=1e-10)

    (hf_logits * weights).sum().backward()
    (our_logits * weights).sum().backward()
    our_grads = {name: p.grad for name, p in ours.named_parameters()}
    for name, param in hf_model.named_parameters():
        if hf_config.tie_word_embeddings and name == "lm_head.weight":
            continue
        torch.testing.assert_close(our_grads[hf_to_axtorch_name(name)], param.grad, rtol=1e-9, atol=1e-10, msg=name)
    return ids, our_logits


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("attention_bias", [False, True])
def test_logits_and_gradients_match_hf_llama(tie, attention_bias, random_hf_model):
    hf_config = _llama_config(tie, attention_bias)
    hf_model = random_hf_model(hf_config)
    _assert_logits_and_gradients_match(hf_config, hf_model, _ours(hf_config, hf_model))


@pytest.mark.parametrize("case", FAMILIES)
def test_logits_and_gradients_match_hf_family(case, random_hf_model):
    hf_config = _family_config(case)
    hf_model = random_hf_model(hf_config)
    ours = _ours(hf_config, hf_model)
    ids, logits = _assert_logits_and_gradients_match(hf_config, hf_model, ours)

    # The feature matters at this length: the same weights without it give other logits.
    plain = _without_scaling_window_and_qk_norm(ours.config).build().double()
    plain.load_state_dict(ours.state_dict(), strict=False)  # less the QK-norm gains
    with torch.no_grad():
        assert (plain(CausalLMInput(input_ids=ids)).logits - logits).abs().max() > 1e-3


def _without_scaling_window_and_qk_norm(config):
    config = copy.deepcopy(config)
    attention = config.decoder.layer.attention
    attention.position = RotaryEmbeddingConfig(theta=attention.position.theta)
    attention.mask = CausalMaskConfig()
    attention.query_norm = attention.key_norm = None
    return config


@pytest.mark.parametrize("case", ["llama", "mistral-window", "qwen3-window"])
def test_kv_cache_decoding_matches_full_forward(case, random_hf_model):
    hf_config = _llama_config(tie=False) if case == "llama" else _family_config(case)
    ours = _ours(hf_config, random_hf_model(hf_config))
    ids = torch.randint(0, hf_config.vocab_size, (2, 12))
    full = ours(CausalLMInput(input_ids=ids)).logits
    caches = ours.allocate_kv_caches(2, 16, dtype=torch.float64, device=torch.device("cpu"))
    prefix = ours(CausalLMInput(input_ids=ids[:, :7], kv_caches=caches)).logits
    steps = [prefix]
    for t in range(7, 12):
        positions = torch.full((2, 1), t)
        steps.append(ours(CausalLMInput(input_ids=ids[:, t : t + 1], positions=positions, kv_caches=caches)).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
