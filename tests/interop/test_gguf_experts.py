"""GGUF files with experts (``qwen2moe``, ``qwen3moe``, Mixtral's ``llama``) and Mistral's window, both ways.

Exports are loaded by transformers' own GGUF loader where it reads the architecture (``qwen2moe``,
``qwen3moe``) and by axtorch's reader, against the exported model's logits. transformers reads no
experts from ``llama`` files, so Mixtral is checked the other way too: a GGUF written here from a
random HF Mixtral, with llama.cpp's names and layout spelt out independently of axtorch's tables.
"""

import json

import numpy as np
import pytest
import tokenizers
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.data.tokenizer import train_byte_level_bpe
from axtorch.interop.gguf import from_gguf
from axtorch.interop.gguf_export import to_gguf
from axtorch.interop.pretrained import check_same_architecture
from axtorch.layers.attention_mask import SlidingWindowMaskConfig
from axtorch.models import CausalLMInput

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

SMALL = [
    "experiment=debug",
    "model.dim=64",
    "model.decoder.num_layers=2",
    "model.decoder.layer.attention.num_heads=4",
    "model.decoder.layer.attention.num_kv_heads=2",
]
# transformers' GGUF reader ignores the expert widths in the metadata and assumes its configs'
# defaults (Qwen3-MoE: 768 and a head size of 128; Qwen2-MoE: 1408, shared 5632), so the models
# it is the oracle for have those widths.
QWEN3_MOE = [
    "model=qwen3_moe_tiny",
    "model.decoder.layer.attention.head_dim=128",
    "model.decoder.layer.feed_forward.hidden_dim=768",
]
QWEN2_MOE = [
    "model=qwen3_moe_tiny",
    "model/qk_norm=none",
    "model.decoder.layer.attention.head_dim=null",  # dim / heads, as transformers assumes
    "model/shared_experts=swiglu",
    "model.decoder.layer.feed_forward.hidden_dim=1408",
    "model.decoder.layer.feed_forward.shared_experts.hidden_dim=5632",
    "model.decoder.layer.feed_forward.shared_expert_gate=true",
    "model.decoder.layer.feed_forward.router.normalize_top_k=false",
    "model.decoder.layer.attention.qkv_projection.bias=true",
]


@pytest.fixture(scope="module")
def tokenizer():
    corpus = "def main():\n    return 0\n" * 40 + "the quick brown fox jumps over the lazy dog 12345\n" * 40
    return train_byte_level_bpe(iter([corpus]), 300, "<|endoftext|>")


def _model(tokenizer, *overrides):
    config = load_experiment_config([*SMALL, f"model.vocab_size={tokenizer.vocab_size}", *overrides])
    torch.manual_seed(0)
    model = config.model.build()
    model.init_weights()
    with torch.no_grad():  # biases start at zero and norms at one: make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def _ids(tokenizer, length=40):
    return torch.randint(0, tokenizer.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))


def _relative(got, expected):
    return float((got - expected).norm() / expected.norm())


def _metadata(path):
    reader = gguf.GGUFReader(path)
    return reader, {name: field.contents() for name, field in reader.fields.items()}


@pytest.mark.parametrize(
    ("architecture", "overrides", "transformers_reads"),
    [
        ("qwen3moe", QWEN3_MOE, True),
        ("qwen2moe", QWEN2_MOE, True),
        ("llama", ["model=mixtral_tiny"], False),
    ],
    ids=["qwen3moe", "qwen2moe", "mixtral"],
)
def test_an_exported_mixture_of_experts_loads_with_the_models_logits(
    architecture, overrides, transformers_reads, tmp_path, tokenizer
):
    model = _model(tokenizer, *overrides)
    experts = model.config.decoder.layer.feed_forward
    to_gguf(model, tokenizer, tmp_path / "moe.gguf", "f32")
    reader, metadata = _metadata(tmp_path / "moe.gguf")
    assert metadata["general.architecture"] == architecture
    assert metadata[f"{architecture}.expert_count"] == experts.num_experts
    assert metadata[f"{architecture}.expert_used_count"] == experts.router.top_k
    # llama.cpp's layout: experts stacked in one tensor per projection, innermost dimension first.
    shapes = {tensor.name: tuple(int(n) for n in tensor.shape) for tensor in reader.tensors}
    assert shapes["blk.0.ffn_gate_exps.weight"] == (64, experts.hidden_dim, experts.num_experts)
    assert shapes["blk.0.ffn_down_exps.weight"] == (experts.hidden_dim, 64, experts.num_experts)
    assert shapes["blk.0.ffn_gate_inp.weight"] == (64, experts.num_experts)
    if architecture == "qwen2moe":
        assert metadata["qwen2moe.expert_shared_feed_forward_length"] == 5632
        assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == (64,)
        assert shapes["blk.0.ffn_up_shexp.weight"] == (64, 5632)

    ids = _ids(tokenizer)
    with torch.no_grad():
        expected = model(CausalLMInput(ids)).logits
        ours, config, _ = from_gguf(tmp_path / "moe.gguf")
        check_same_architecture(model.config, config, "gguf:moe.gguf")  # raises naming any difference
        assert _relative(ours(CausalLMInput(ids)).logits, expected) < 1e-6
        if transformers_reads:
            theirs = transformers.AutoModelForCausalLM.from_pretrained(
                tmp_path, gguf_file="moe.gguf", dtype=torch.float32
            ).eval()
            assert _relative(theirs(ids).logits, expected) < 1e-5


def _hf_mixtral(vocab_size):
    config = transformers.MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("gate.weight"):
                param.add_(0.5 * torch.randn_like(param))
    return model


def _interleave(rows, heads):
    """llama.cpp's converter's Q/K row permutation, written out as it does it."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def test_a_mixtral_gguf_written_as_llama_cpp_does_gives_hf_mixtrals_logits(tmp_path, tokenizer):
    hf = _hf_mixtral(tokenizer.vocab_size)
    state = {name: t.detach().numpy() for name, t in hf.state_dict().items()}
    writer = gguf.GGUFWriter(str(tmp_path / "mixtral.gguf"), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(hf.config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    description = tokenizer.description()
    inner = tokenizers.Tokenizer.from_str(json.dumps(description))
    tokens = [inner.id_to_token(i) for i in range(tokenizer.vocab_size)]
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in description["model"]["merges"]])
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(2):
        layer = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_q.weight", _interleave(state[layer + "self_attn.q_proj.weight"], 4))
        writer.add_tensor(f"blk.{i}.attn_k.weight", _interleave(state[layer + "self_attn.k_proj.weight"], 2))
        writer.add_tensor(f"blk.{i}.attn_v.weight", state[layer + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", state[layer + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_norm.weight", state[layer + "input_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", state[layer + "post_attention_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", state[layer + "mlp.gate.weight"])
        # transformers 5 holds the experts fused: gate_up_proj [E, 2 * hidden, dim], gate rows first.
        gate, up = np.split(state[layer + "mlp.experts.gate_up_proj"], 2, axis=1)
        writer.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
        writer.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(up))
        writer.add_tensor(f"blk.{i}.ffn_down_exps.weight", state[layer + "mlp.experts.down_proj"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, config, _ = from_gguf(tmp_path / "mixtral.gguf")
    assert config.decoder.layer.feed_forward.num_experts == 4
    ids = _ids(tokenizer, 24)
    with torch.no_grad():
        assert _relative(ours(CausalLMInput(ids)).logits, hf(input_ids=ids).logits) < 1e-5


def test_mistrals_window_goes_to_gguf_and_back(tmp_path, tokenizer):
    model = _model(tokenizer, "model=mistral_tiny", "model.decoder.layer.attention.mask.window=8")
    to_gguf(model, tokenizer, tmp_path / "mistral.gguf", "f32")
    _, metadata = _metadata(tmp_path / "mistral.gguf")
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.attention.sliding_window"] == 8
    ours, config, _ = from_gguf(tmp_path / "mistral.gguf")
    assert config.decoder.layer.attention.mask == SlidingWindowMaskConfig(window=8)
    ids = _ids(tokenizer, 40)  # five windows long: the window changes the logits
    with torch.no_grad():
        assert _relative(ours(CausalLMInput(ids)).logits, model(CausalLMInput(ids)).logits) < 1e-6
