"""``from_gguf`` on small GGUF files written here the way llama.cpp's converter writes them.

Each file comes from a random HF Llama, so HF's logits are the oracle for the GGUF layout (Q/K
row order, reversed shapes, quantised blocks, absent ``output`` when tied); the SmolLM2 test
checks the same against a real file and transformers' own GGUF loader.
"""

import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from hf_shapes import HF_SHAPE

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.interop import from_gguf
from axtorch.models import CausalLMInput

MERGES = ["h e", "l l"]
TOKENS = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "he", "ll", "<|endoftext|>", "<|user|>"]
SHAPE = {
    **HF_SHAPE,
    "vocab_size": len(TOKENS),
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "rope_theta": 5000.0,
    "rms_norm_eps": 1e-5,
}
#: HF parameter name (layer part) -> GGUF tensor name, written independently of axtorch's table.
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _gguf_name(hf_name: str) -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


def _llama_cpp_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, HF's rotate-half halves become interleaved pairs."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _hf_model(tie: bool, family: str = "Llama"):
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**SHAPE, tie_word_embeddings=tie)
    config._attn_implementation = "sdpa"
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # HF initialises norms to 1: perturb so they are tested
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def _write_gguf(
    path,
    hf_model,
    *,
    quantized=(),
    architecture="llama",
    tokenizer_model="gpt2",
    pre="gpt-2",
    rope_scaling=None,
    extra_tensors=(),
):
    """Write ``hf_model`` as llama.cpp would; names in ``quantized`` stored as Q8_0 (HF weights updated to match)."""
    config = hf_model.config
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)  # Qwen3's 128 is not hidden_size / heads
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(SHAPE["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(rope_scaling)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(TOKENS) - 2) + [gguf.TokenType.CONTROL] * 2)
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(TOKENS.index("<|endoftext|>"))
    for name, param in hf_model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        values = param.detach().numpy()
        if name in quantized:
            stored = gguf.quants.quantize(values, Q8_0)
            with torch.no_grad():  # the oracle sees what the file holds
                param.copy_(torch.from_numpy(gguf.quants.dequantize(stored, Q8_0)))
            values = param.detach().numpy()
        if architecture == "gemma" and name.endswith("norm.weight"):
            values = values + 1  # llama.cpp stores the 1 + weight that Gemma's norms multiply by
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(name.split(".")[-2])
        if heads and architecture == "llama":  # llama.cpp runs the other families with rotate-half RoPE
            values = _llama_cpp_rows(values, heads)
        if name in quantized:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(values, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(values))
    for name, values in extra_tensors:
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("tie", [False, True])
def test_logits_equal_hf_llama(tie, tmp_path):
    hf_model = _hf_model(tie)
    quantized = ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight")
    path = _write_gguf(tmp_path / "model.gguf", hf_model, quantized=quantized)

    model, config, _ = from_gguf(path)

    assert config.tie_embeddings == tie
    assert config.decoder.layer.attention.position.theta == SHAPE["rope_theta"]
    ids = torch.randint(0, len(TOKENS), (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits
        actual = model(CausalLMInput(input_ids=ids)).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def _llama_cpp_rope_factors(config) -> np.ndarray:
    """Llama 3's per-pair frequency divisors, computed as llama.cpp's converter writes rope_freqs.weight."""
    scaling, head_dim = config.rope_scaling, config.hidden_size // config.num_attention_heads
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * np.pi * SHAPE["rope_theta"] ** (i / head_dim)
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_a_llama_3_1_file_with_rope_factors_gives_the_logits_of_hf_llama_with_llama3_rope(tmp_path):
    torch.manual_seed(0)
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    config = transformers.LlamaConfig(
        **SHAPE, rope_scaling={**scaling, "original_max_position_embeddings": 8192}, tie_word_embeddings=True
    )
    hf_model = transformers.LlamaForCausalLM(config).eval()
    factors = _llama_cpp_rope_factors(config)
    assert factors.max() > 1.0 and factors.min() == 1.0 and len(set(factors.tolist())) > 2  # all three bands
    path = _write_gguf(tmp_path / "model.gguf", hf_model, extra_tensors=[("rope_freqs.weight", factors)])
    model, ours, _ = from_gguf(path)
    assert ours.decoder.layer.attention.position.factor == 8.0
    ids = torch.randint(0, len(TOKENS), (2, 40), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(40).expand(2, -1) * 300  # far positions, where the bands differ
    with torch.no_grad():
        expected = hf_model(input_ids=ids, position_ids=positions).logits
        actual = model(CausalLMInput(input_ids=ids, positions=positions)).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family, architecture", [("Qwen2", "qwen2"), ("Qwen3", "qwen3")])
def test_qwen_files_give_the_logits_of_hf_qwen(family, architecture, tmp_path):
    """Qwen2's Q/K/V biases and Qwen3's QK-norm, with rotate-half rows as llama.cpp stores them."""
    hf_model = _hf_model(tie=True, family=family)
    path = _write_gguf(tmp_path / "model.gguf", hf_model, architecture=architecture, pre="qwen2")
    model = from_gguf(path)[0]
    ids = torch.randint(0, len(TOKENS), (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits
        actual = model(CausalLMInput(input_ids=ids)).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_gemma_files_give_the_logits_of_hf_gemma_and_export_back(tmp_path):
    """Gemma's scaled embeddings, GELU-tanh MLP and 1 + weight norms, as llama.cpp stores them."""
    from axtorch.interop import to_gguf

    hf_model = _hf_model(tie=True, family="Gemma")
    path = _write_gguf(tmp_path / "model.gguf", hf_model, architecture="gemma")
    model, _, tokenizer = from_gguf(path)
    ids = torch.randint(0, len(TOKENS), (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits
        torch.testing.assert_close(model(CausalLMInput(input_ids=ids)).logits, expected, rtol=0, atol=1e-5)
        to_gguf(model, tokenizer, tmp_path / "exported.gguf", "f32")
        assert gguf.GGUFReader(tmp_path / "exported.gguf").fields["general.architecture"].contents() == "gemma"
        back = from_gguf(tmp_path / "exported.gguf")[0]
        torch.testing.assert_close(back(CausalLMInput(input_ids=ids)).logits, expected, rtol=0, atol=1e-5)


def test_tokenizer_keeps_control_tokens_whole_and_decodes_exactly(tmp_path):
    _, _, tokenizer = from_gguf(_write_gguf(tmp_path / "model.gguf", _hf_model(tie=True)))

    text = "héllo <|user|> wörld"
    ids = tokenizer.encode(text)
    assert TOKENS.index("<|user|>") in ids and TOKENS.index("ll") in ids  # whole control token; merges applied
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.vocab_size == len(TOKENS)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(architecture="phi3"), "general.architecture='phi3'"),
        (dict(rope_scaling=gguf.RopeScalingType.LINEAR), "llama.rope.scaling.type='linear'"),
        (dict(tokenizer_model="bert"), "tokenizer.ggml.model='bert'"),
        (dict(pre="falcon"), "tokenizer.ggml.pre='falcon'"),
        (
            dict(extra_tensors=[("rope_freqs.weight", np.linspace(1, 3, 8, dtype=np.float32))]),
            "'rope_freqs.weight' holds RoPE frequency divisors that are not Llama 3's",
        ),
    ],
)
def test_refuses_what_axtorch_cannot_represent(options, message, tmp_path):
    path = _write_gguf(tmp_path / "model.gguf", _hf_model(tie=True), **options)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        from_gguf(path)


def test_metadata_that_disagrees_with_the_tensors_is_refused_naming_both(tmp_path, monkeypatch):
    model = _hf_model(tie=True)
    add_head_count = gguf.GGUFWriter.add_head_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count", lambda writer, count: add_head_count(writer, 8))
    wrong_heads = _write_gguf(tmp_path / "heads.gguf", model)  # 4 heads of 16 in the tensors
    monkeypatch.undo()
    said = (
        r"heads\.gguf: its metadata and its tensors disagree: decoder\.layers\.0\.attention\.q_proj\.weight is "
        r"\[64, 64\], the metadata make it \[128, 64\];.*llama\.attention\.head_count=8"
    )
    with pytest.raises(ValueError, match=said):
        from_gguf(wrong_heads)
    with pytest.raises(ConfigError, match=r"init_from=.*its metadata and its tensors disagree"):
        load_experiment_config([f"init_from=gguf:{wrong_heads}"])

    class WithoutOneTensor:  # as a file written without layer 1's down projection
        config = model.config

        def state_dict(self):
            return {k: v for k, v in model.state_dict().items() if k != "model.layers.1.mlp.down_proj.weight"}

    missing = _write_gguf(tmp_path / "missing.gguf", WithoutOneTensor())
    with pytest.raises(ValueError, match=r"decoder\.layers\.1\.feed_forward\.down_proj\.weight is missing"):
        from_gguf(missing)


def test_a_truncated_file_is_refused_by_name_before_any_weight_is_used(tmp_path):
    path = _write_gguf(tmp_path / "model.gguf", _hf_model(tie=True))
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) * 2 // 3])
    said = r"model\.gguf is not a whole GGUF file \([\d,]+ bytes; truncated or corrupt\)"
    with pytest.raises(ValueError, match=said):
        from_gguf(path)
    with pytest.raises(ConfigError, match=r"init_from.*not a whole GGUF file"):
        load_experiment_config([f"init_from=gguf:{path}"])
