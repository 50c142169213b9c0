"""Load llama.cpp GGUF files: model, config, tokenizer.

A GGUF file is translated into the HF representation of its family (config dict, parameter
names, rotate-half Q/K rows) and built by that family's adapter (``interop.families``), so one
code path maps onto axtorch. The families say which GGUF architectures they are
(``GGUFLayout``): ``llama`` (Llama, Mistral with its window, Mixtral with experts), ``qwen2``,
``qwen3``, ``qwen2moe``, ``qwen3moe``. What GGUF adds is undone here: quantised blocks are
dequantised (``gguf.quants.dequantize``), shapes are stored innermost-first, and for ``llama``
files llama.cpp's converter reordered the Q/K rows for its interleaved RoPE. ``gguf_export``
writes such files.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import tokenizers
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from axtorch.data.tokenizer import Tokenizer
from axtorch.interop.families import Family, gguf_architectures, gguf_families, model_from_hf_tensors
from axtorch.interop.families.family import GGUFLayout, getter
from axtorch.interop.families.llama_layout import offset_norm
from axtorch.interop.sentencepiece_vocab import sentencepiece_bpe
from axtorch.layers.relative_position import Llama3RotaryEmbeddingConfig, RotaryEmbeddingConfig
from axtorch.models.causal_lm import CausalLM, CausalLMConfig

if TYPE_CHECKING:
    from gguf import GGUFReader

_LAYER_TENSOR = re.compile(r"blk\.(?P<i>\d+)\.(?P<name>\w+)\.(?P<suffix>weight|bias)$")
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # Mixtures of experts: the router, the stacked experts [E, ...] (canonical HF names, which
    # have no suffix: see ``families.experts``) and Qwen2-MoE's gated shared expert.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
#: GGUF tensors that are stacked experts: HF's canonical names for them carry no ``.weight``.
STACKED_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
#: llama.cpp stores the shared expert's gate as a vector, HF as a [1, dim] matrix.
SHARED_EXPERT_GATE = "ffn_gate_inp_shexp"
#: ``tokenizer.ggml.model`` values: llama.cpp names its tokenizer kinds after the models that
#: brought them (GPT-2's byte-level BPE, Llama's SentencePiece), whatever the file's architecture.
BYTE_LEVEL_BPE_TOKENIZER = "gpt2"
SENTENCEPIECE_TOKENIZER = "llama"
#: Tokens that end a reply wherever a vocabulary has them, as llama.cpp recognises them by their
#: text (``llama_vocab``'s end-of-generation set): Gemma's ``<end_of_turn>``, ChatML's ``<|im_end|>``,
#: Llama 3's ``<|eot_id|>``, ... A GGUF names only one EOS; a chat model ends its turn with these.
END_OF_GENERATION_TOKENS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    }
)
#: Llama 3.1's per-pair RoPE frequency divisors, as llama.cpp stores them.
ROPE_FACTORS = "rope_freqs.weight"
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

#: Llama 3's split (tiktoken's cl100k pattern): case-insensitive contractions, letters with one
#: leading non-letter, numbers of up to three digits, punctuation runs with their newlines.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Qwen2's split: Llama 3's with every digit on its own.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: DeepSeek LLM's letters: an optional space, then a run of cased letters (Latin, Greek, Cyrillic,
#: Armenian, Georgian, Cherokee, letterlike symbols, full-width Latin, ...), one range list copied
#: from its tokenizer.json. Written with escapes: the list holds compatibility characters (U+212A
#: KELVIN SIGN, U+2126 OHM SIGN, ...) that a Unicode-normalising editor would silently rewrite.
DEEPSEEK_LLM_LETTERS = (
    "\\s?["
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102"
    "\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
    "]+"
)
#: DeepSeek's punctuation: an optional space, then ASCII punctuation (the ranges also hold the
#: ASCII letters, which the letters split has already isolated), full-width forms, curly quotes,
#: the ideographic space and CJK full stops.
DEEPSEEK_PUNCTUATION = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
#: DeepSeek's CJK runs: CJK ideographs, everything from U+0800 up to them, and Hangul syllables.
DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
#: DeepSeek LLM's (and V2's) splits, each applied to the pieces the one before left: newlines
#: alone, letters, punctuation, trailing whitespace, CJK. Digits then go one by one.
DEEPSEEK_LLM_SPLITS = ("[\r\n]", DEEPSEEK_LLM_LETTERS, DEEPSEEK_PUNCTUATION, r"\s+$", DEEPSEEK_CJK)
#: DeepSeek Coder's splits: as DeepSeek LLM's, with any Unicode letters and punctuation.
DEEPSEEK_CODER_SPLITS = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK)


def _byte_level(*first: pre_tokenizers.PreTokenizer, use_regex: bool = True) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    return pre_tokenizers.Sequence([*first, byte_level]) if first else byte_level


def _split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return _byte_level(pre_tokenizers.Split(Regex(pattern), behavior="isolated"), use_regex=False)


def _splits_then_digits(*patterns: str) -> pre_tokenizers.PreTokenizer:
    """Each pattern splits the pieces the one before left (tokenizer.json's ``Sequence``), then every digit alone."""
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in patterns]
    return _byte_level(*splits, pre_tokenizers.Digits(individual_digits=True), use_regex=False)


#: ``tokenizer.ggml.pre`` -> the pre-tokenizer llama.cpp applies before byte-level BPE, built as the
#: model's own tokenizer.json declares it: GPT-2's regex (``smollm`` and ``command-r`` split every
#: digit off first), a regex of its own (``llama-bpe``, ``qwen2``), or DeepSeek's sequence of
#: splits. Where llama.cpp's regex engine reads DeepSeek's differently (digit runs, spaces beyond
#: U+0800) tokenizer.json wins; docs/interop.md lists the differences.
PRE_TOKENIZERS = {
    "gpt-2": lambda: _byte_level(),
    "smollm": lambda: _byte_level(pre_tokenizers.Digits(individual_digits=True)),
    "llama-bpe": lambda: _split(LLAMA3_SPLIT),
    "qwen2": lambda: _split(QWEN2_SPLIT),
    # After smollm, which GGUF export names for this same pre-tokenizer; llama.cpp splits both alike.
    "command-r": lambda: _byte_level(pre_tokenizers.Digits(individual_digits=True)),
    "deepseek-llm": lambda: _splits_then_digits(*DEEPSEEK_LLM_SPLITS),
    "deepseek-coder": lambda: _splits_then_digits(*DEEPSEEK_CODER_SPLITS),
}

#: The pre-tokenizers after which llama.cpp takes a pre-token that is in the vocabulary whole, as one
#: token, before any merge (``ignore_merges`` in its ``llama-vocab.cpp``), as the model's own
#: tokenizer.json does (``"ignore_merges": true`` in Llama 3's BPE model): Llama 3 encodes "Cửa Việt"
#: as [34, 91163, 101798], its merges alone as [34, 91163, 11655, 26298, 83]. Of those rebuilt here
#: only ``llama-bpe``; llama.cpp also sets it for ``tekken``, ``youtu``, ``minicpm5`` and
#: ``granite-embed-multi-97m``, which ``PRE_TOKENIZERS`` does not rebuild.
IGNORE_MERGES = frozenset({"llama-bpe"})

_REQUIRED = object()


def from_gguf(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> tuple[CausalLM, CausalLMConfig, Tokenizer]:
    """Load a GGUF file of a registered family's architecture, with its tokenizer.

    Weights are dequantised to float32, then cast to ``dtype``. Raises ``ValueError`` for
    anything axtorch cannot represent (other architectures, RoPE scaling, tokenizer kinds).
    """
    reader = read_gguf(path)
    family, config = _family_and_config(reader, path)
    tokenizer = _tokenizer(reader)
    attention = config.decoder.layer.attention
    assert family.gguf is not None  # gguf_families lists only families with a layout
    layout = family.gguf
    tensors = _hf_tensors(reader, attention.num_heads, attention.resolved_kv_heads(), layout)
    return model_from_hf_tensors(family, config, tensors, dtype), config, tokenizer


def gguf_model_config(path: str | os.PathLike[str]) -> CausalLMConfig:
    """The model config a GGUF file describes, from its metadata and tensor names alone (no weight is read)."""
    return _family_and_config(read_gguf(path), path)[1]


def _family_and_config(reader: GGUFReader, path: str | os.PathLike[str]) -> tuple[Family, CausalLMConfig]:
    architecture = _metadata(reader, "general.architecture")
    if not gguf_families(architecture):
        raise ValueError(
            f"{path}: GGUF general.architecture={architecture!r} is not supported; supported: {gguf_architectures()}"
        )
    family, hf = _hf_config(reader, architecture)
    config = family.config_from_hf(getter(hf))
    if disagreements := _disagreements(reader, family, config):
        more = f"; and {len(disagreements) - 6} more" if len(disagreements) > 6 else ""
        shown = "; ".join(disagreements[:6]) + more
        said = ", ".join(f"{key}={_metadata(reader, key, None)}" for key in _shape_keys(architecture))
        raise ValueError(f"{path}: its metadata and its tensors disagree: {shown} (the metadata: {said})")
    return family, config


#: The metadata that sizes a model's tensors, named when the tensors disagree with it.
_SHAPE_KEYS = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
)


def _shape_keys(architecture: str) -> list[str]:
    return [f"{architecture}.{key}" for key in _SHAPE_KEYS]


def _disagreements(reader: GGUFReader, family: Family, config: CausalLMConfig) -> list[str]:
    """Where the file's tensors (names and shapes, from its header: no weight is read) differ from
    those of the model its metadata describes: a wrong head count, a missing or extra tensor."""
    attention = config.decoder.layer.attention
    assert family.gguf is not None  # gguf_families lists only families with a layout
    found = _hf_tensors(reader, attention.num_heads, attention.resolved_kv_heads(), family.gguf, read=False)
    held = {name: tuple(tensor.shape) for name, tensor in family.tensors_from_hf(config, found)}
    with torch.device("meta"):
        wanted = {name: tuple(tensor.shape) for name, tensor in config.build().state_dict().items()}
    problems = [f"{name} is missing" for name in wanted if name not in held]
    problems += [
        f"{name} is {list(held[name])}, the metadata make it {list(shape)}"
        for name, shape in wanted.items()
        if name in held and held[name] != shape
    ]
    problems += [f"{name} is not part of the model the metadata describe" for name in held if name not in wanted]
    return problems


def tokenizer_from_gguf(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer a GGUF file carries, also from a vocabulary-only file (no tensors needed)."""
    return _tokenizer(read_gguf(path))


def read_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """gguf's reader of the file at ``path``, with plain-array views (``_plain_array_reader``): 3x
    faster to open than ``gguf.GGUFReader`` on a large vocabulary."""
    try:
        reader = _plain_array_reader()
    except ImportError as error:
        raise ImportError("GGUF files need the gguf package: pip install 'gguf>=0.10'") from error
    try:
        return reader(path)
    except (ValueError, IndexError) as error:  # gguf's reader meets the end of a short file as a bad shape
        size = os.path.getsize(path)
        raise ValueError(f"{path} is not a whole GGUF file ({size:,} bytes; truncated or corrupt): {error}") from error


@functools.cache
def _plain_array_reader() -> type[GGUFReader]:
    """``GGUFReader`` whose arrays are plain ndarray views of the mapped file, not ``np.memmap``s.

    The reader takes a view per string of the vocabulary and merges (millions for Gemma 3's 262k
    tokens), and each view of numpy's ``memmap`` subclass runs Python (``__array_finalize__``):
    opening Gemma 3 270M's file took 7.7 s, 2.5 s with plain views of the same read-only mapping.
    """
    import numpy as np
    from gguf import GGUFReader

    class PlainArrayReader(GGUFReader):
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._mapped

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._mapped = mapped.view(np.ndarray)

    return PlainArrayReader


def tokenizer_settings(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What HF's ``tokenizer_config.json`` would hold for the GGUF's tokenizer (``_settings``)."""
    return _settings(read_gguf(path))


def _settings(reader: GGUFReader) -> dict[str, Any]:
    """The GGUF's chat template, the text of its BOS and EOS tokens as far as the file names them,
    and whether texts start with BOS (``tokenizer.ggml.add_bos_token``; without it, llama.cpp's
    default: SentencePiece vocabularies add one, byte-level BPE ones do not)."""
    tokens = _metadata(reader, "tokenizer.ggml.tokens")
    settings: dict[str, Any] = {}
    for name in ("bos", "eos"):
        token_id = _metadata(reader, f"tokenizer.ggml.{name}_token_id", None)
        if token_id is not None:
            settings[f"{name}_token"] = str(tokens[int(token_id)])
    sentencepiece = _metadata(reader, "tokenizer.ggml.model") == SENTENCEPIECE_TOKENIZER
    settings["add_bos_token"] = bool(_metadata(reader, "tokenizer.ggml.add_bos_token", sentencepiece))
    template = _metadata(reader, "tokenizer.chat_template", None)
    if template is not None:
        settings["chat_template"] = str(template)
    return settings


def _end_of_generation_ids(reader: GGUFReader, tokens: list[str]) -> list[int]:
    """The ids llama.cpp ends generation on: the EOS, end-of-turn and end-of-message ids the file
    names, and every token whose text is one of ``END_OF_GENERATION_TOKENS``."""
    named = (_metadata(reader, f"tokenizer.ggml.{name}_token_id", None) for name in ("eos", "eot", "eom"))
    by_text = (index for index, token in enumerate(tokens) if token in END_OF_GENERATION_TOKENS)
    return sorted({*(int(token_id) for token_id in named if token_id is not None), *by_text})


def _metadata(reader: GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF metadata {key} is missing")
        return default
    return field.contents()


def _hf_config(reader: GGUFReader, architecture: str) -> tuple[Family, dict[str, Any]]:
    """The family and HF ``config.json`` dict equal in function to the GGUF's ``<architecture>.*`` metadata."""

    def key(name: str, default: Any = _REQUIRED) -> Any:
        return _metadata(reader, f"{architecture}.{name}", default)

    scaling_type = key("rope.scaling.type", "none")
    if scaling_type != "none":
        raise ValueError(
            f"GGUF {architecture}.rope.scaling.type={scaling_type!r} is not supported: "
            f"only unscaled RoPE and Llama 3's ({ROPE_FACTORS})"
        )
    dim = key("embedding_length")
    num_heads = key("attention.head_count")
    head_dim = key("attention.key_length", dim // num_heads)
    rotary_dim = key("rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(
            f"GGUF {architecture}.rope.dimension_count={rotary_dim} is not supported: "
            f"RoPE must rotate the whole head ({head_dim})"
        )
    tensor_names = {tensor.name for tensor in reader.tensors}
    rope_theta = key("rope.freq_base", 10000.0)
    rope_scaling = None
    if ROPE_FACTORS in tensor_names:
        rope_scaling = _llama3_rope_scaling(_rope_factors(reader), rope_theta, head_dim)
    has_qkv_bias = "blk.0.attn_q.bias" in tensor_names
    hf = {
        "rope_scaling": rope_scaling,
        "vocab_size": len(_metadata(reader, "tokenizer.ggml.tokens")),
        "hidden_size": dim,
        "intermediate_size": key("feed_forward_length", None),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": rope_theta,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": has_qkv_bias,
        "qkv_bias": has_qkv_bias,
    }
    layouts = [(family, family.gguf) for family in gguf_families(architecture) if family.gguf is not None]
    for _, layout in layouts:
        hf.update(layout.config_fields(key))
    held = [family for family, layout in layouts if layout.holds(hf)]
    if not held:
        names = ", ".join(family.architecture for family, _ in layouts)
        raise ValueError(f"GGUF {architecture} metadata matches none of the families it may hold ({names})")
    return held[0], {**hf, "model_type": held[0].model_type}


def _rope_factors(reader: GGUFReader) -> torch.Tensor:
    from gguf.quants import dequantize

    tensor = next(t for t in reader.tensors if t.name == ROPE_FACTORS)
    return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).flatten().double()


#: Llama 3.1's long-context RoPE settings (``low_freq_factor``, ``high_freq_factor``,
#: ``original_max_position_embeddings``) that the released models use; the factor is read from the file.
LLAMA3_ROPE_BANDS = ((1.0, 4.0, 8192),)


def rope_divisors(position: RotaryEmbeddingConfig, head_dim: int) -> torch.Tensor:
    """float64 [head_dim / 2] plain RoPE's frequencies divided by ``position``'s: llama.cpp's ``rope_freqs``."""
    cpu = torch.device("cpu")
    plain = RotaryEmbeddingConfig(theta=position.theta).inverse_frequencies(head_dim, cpu).double()
    return plain / position.inverse_frequencies(head_dim, cpu).double()


def _llama3_rope_scaling(factors: torch.Tensor, theta: float, head_dim: int) -> dict[str, Any]:
    """HF's ``rope_scaling`` whose Llama 3 frequencies divide plain RoPE's by ``factors`` (``rope_freqs.weight``).

    llama.cpp's converter stores the divisors per rotated pair instead of the settings; the
    settings are recovered by recomputing the divisors for the released bands and the largest
    divisor as ``factor``. Divisors that none reproduces are refused.
    """
    factor = float(factors.max())
    for low, high, original in LLAMA3_ROPE_BANDS:
        settings = Llama3RotaryEmbeddingConfig(
            theta=theta,
            factor=factor,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=original,
        )
        expected = rope_divisors(settings, head_dim)
        if expected.shape == factors.shape and torch.allclose(expected, factors, rtol=1e-5, atol=0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise ValueError(
        f"GGUF tensor {ROPE_FACTORS!r} holds RoPE frequency divisors that are not Llama 3's for any released "
        f"setting (low/high frequency factors and original context {list(LLAMA3_ROPE_BANDS)})"
    )


def _hf_name(gguf_name: str, layout: GGUFLayout) -> str:
    match = _LAYER_TENSOR.match(gguf_name)
    layer_names = {**LAYER_NAMES, **dict(layout.layer_names)}
    if match and match["name"] in layer_names:
        suffix = "" if match["name"] in STACKED_EXPERTS else f".{match['suffix']}"
        return f"model.layers.{match['i']}.{layer_names[match['name']]}{suffix}"
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{GLOBAL_NAMES[stem]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in an axtorch model")


def _halves_from_interleaved(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head [x0, y0, x1, y1, ...] -> HF's [x0, x1, ..., y0, y1, ...]."""
    head_dim = rows.shape[0] // num_heads
    return rows.reshape(num_heads, head_dim // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def interleaved_from_halves(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order from HF's: the inverse of ``_halves_from_interleaved``."""
    head_dim = rows.shape[0] // num_heads
    return rows.reshape(num_heads, 2, head_dim // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _hf_tensors(
    reader: GGUFReader, num_heads: int, num_kv_heads: int, layout: GGUFLayout, read: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named float32 tensors in HF layout (and HF's norm weights), dequantised one at a time;
    with ``read=False`` on the meta device, their shapes alone, from the file's header."""
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        if tensor.name == ROPE_FACTORS:
            continue  # read into the config (``_llama3_rope_scaling``)
        name = _hf_name(tensor.name, layout)
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if not read:
            weight = torch.empty(shape, device="meta")
        else:
            values = dequantize(tensor.data, tensor.tensor_type)
            if not values.flags.writeable:  # unquantised data is a read-only view of the memory map
                values = values.copy()
            weight = torch.from_numpy(values).reshape(shape)
        if tensor.name.endswith(f"{SHARED_EXPERT_GATE}.weight"):
            weight = weight.reshape(1, -1)
        if layout.interleaved_qk and ".q_proj." in name:
            weight = _halves_from_interleaved(weight, num_heads)
        elif layout.interleaved_qk and ".k_proj." in name:
            weight = _halves_from_interleaved(weight, num_kv_heads)
        yield name, offset_norm(name, weight, -layout.norm_offset)


def _tokenizer(reader: GGUFReader) -> Tokenizer:
    """The GGUF's tokenizer as a ``tokenizers`` tokenizer: byte-level BPE (``tokenizer.ggml.model``
    ``gpt2``) or SentencePiece BPE with byte fallback (``llama``: Llama 2, Mistral, Phi-3)."""
    from gguf import TokenType

    kind = _metadata(reader, "tokenizer.ggml.model")
    if kind == SENTENCEPIECE_TOKENIZER:
        tokens = _metadata(reader, "tokenizer.ggml.tokens")
        inner = sentencepiece_bpe(
            tokens,
            _metadata(reader, "tokenizer.ggml.scores"),
            _metadata(reader, "tokenizer.ggml.token_type"),
            bool(_metadata(reader, "tokenizer.ggml.add_space_prefix", True)),
        )
        return _with_special_tokens(reader, inner, tokens)
    if kind != BYTE_LEVEL_BPE_TOKENIZER:
        raise ValueError(
            f"GGUF tokenizer.ggml.model={kind!r} is not supported; supported: {BYTE_LEVEL_BPE_TOKENIZER!r} "
            f"(byte-level BPE), {SENTENCEPIECE_TOKENIZER!r} (SentencePiece BPE)"
        )
    pre = _metadata(reader, "tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}")
    tokens = _metadata(reader, "tokenizer.ggml.tokens")
    types = _metadata(reader, "tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in _metadata(reader, "tokenizer.ggml.merges")]

    vocab = {token: i for i, token in enumerate(tokens)}
    inner = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in IGNORE_MERGES))
    inner.pre_tokenizer = PRE_TOKENIZERS[pre]()
    inner.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must match whole in text, never be split by BPE.
    inner.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, types)
            if kind == TokenType.CONTROL
        ]
    )
    inner.add_tokens(
        [AddedToken(token, normalized=False) for token, kind in zip(tokens, types) if kind == TokenType.USER_DEFINED]
    )
    return _with_special_tokens(reader, inner, tokens)


def _with_special_tokens(reader: GGUFReader, inner: tokenizers.Tokenizer, tokens: list[str]) -> Tokenizer:
    """``inner`` ending documents at the GGUF's EOS, starting them with its BOS where the file adds
    one, ending replies at its end-of-generation tokens, and carrying its chat template."""
    eos_token = tokens[_metadata(reader, "tokenizer.ggml.eos_token_id")]
    return Tokenizer(inner, eos_token, _settings(reader), _end_of_generation_ids(reader, tokens))
