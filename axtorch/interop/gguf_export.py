"""Write a model and its tokenizer as a llama.cpp GGUF file, in its family's GGUF architecture.

The model goes through its HF representation (the family ``to_hf`` would write: its config
dict, canonical HF tensor names), and the reader's translation is inverted: GGUF metadata keys
for the config (the family's own through ``GGUFLayout.metadata``), GGUF tensor names, llama.cpp's
interleaved Q/K row order (``llama`` files only), and quantisation. The
tokenizer must be byte-level BPE with one of the pre-tokenizers the reader rebuilds
(``gguf.PRE_TOKENIZERS``: GPT-2's, which axtorch trains, SmolLM's, Llama 3's, Qwen2's), or the
SentencePiece BPE vocabulary the reader rebuilds from a ``llama`` tokenizer (Llama 2, Gemma).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import tokenizers
import torch
from tokenizers import models

from axtorch.data.tokenizer import Tokenizer
from axtorch.interop.families import family_for
from axtorch.interop.families.family import GGUFLayout
from axtorch.interop.families.llama_layout import axtorch_to_hf_state_dict
from axtorch.interop.gguf import (
    BYTE_LEVEL_BPE_TOKENIZER,
    GLOBAL_NAMES,
    IGNORE_MERGES,
    LAYER_NAMES,
    LLAMA3_ROPE_BANDS,
    PRE_TOKENIZERS,
    ROPE_FACTORS,
    SENTENCEPIECE_TOKENIZER,
    SHARED_EXPERT_GATE,
    interleaved_from_halves,
    rope_divisors,
)
from axtorch.layers.relative_position import RotaryEmbeddingConfig
from axtorch.models.causal_lm import CausalLM

#: Weight-matrix formats ``to_gguf`` writes (those the ``gguf`` package can quantise); norms and
#: biases are always float32, as llama.cpp's converter writes them.
GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
_GGUF_NAMES = {hf: gguf for gguf, hf in LAYER_NAMES.items()}
_GLOBAL_GGUF_NAMES = {hf: gguf for gguf, hf in GLOBAL_NAMES.items()}
#: SentencePiece's byte-fallback pieces, ``<0x00>`` to ``<0xFF>``.
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


def to_gguf(model: CausalLM, tokenizer: Tokenizer, path: str | os.PathLike[str], dtype: str = "f16") -> None:
    """Write ``model`` and ``tokenizer`` to ``path`` for llama.cpp, Ollama, or transformers' GGUF loader.

    ``dtype`` is one of ``GGUF_DTYPES`` for the weight matrices: ``q8_0`` is 32-value blocks with
    one f16 scale each, ``q4_0``/``q4_1``/``q5_0``/``q5_1`` llama.cpp's 4- and 5-bit blocks.
    Raises ``ValueError``, before writing anything, for a model that no GGUF architecture of a
    family can express or a tokenizer llama.cpp cannot rebuild.
    """
    import gguf

    if dtype not in GGUF_DTYPES:
        raise ValueError(f"GGUF dtype {dtype!r} is not supported; supported: {', '.join(GGUF_DTYPES)}")
    family, hf = family_for(model.config)
    layout = _layout(family.gguf, hf)
    vocab = _tokenizer_fields(tokenizer, model.config.vocab_size)
    writer = gguf.GGUFWriter(os.fspath(path), layout.architecture)
    writer.add_name("axtorch export")
    writer.add_file_type(
        gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType[f"MOSTLY_{dtype.upper()}"]
    )
    if dtype.startswith("q"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    head_dim = hf["head_dim"]
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    for name, value in layout.metadata(hf).items():
        _add_metadata(writer, f"{layout.architecture}.{name}", value)
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(hf["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(hf["rms_norm_eps"]))
    writer.add_vocab_size(model.config.vocab_size)
    writer.add_tokenizer_model(vocab["model"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    if vocab["model"] == SENTENCEPIECE_TOKENIZER:
        writer.add_token_scores(vocab["scores"])
        writer.add_add_space_prefix(vocab["add_space_prefix"])
    else:
        writer.add_tokenizer_pre(vocab["pre"])
        writer.add_token_merges(vocab["merges"])
    # A chat model ends its turn with its tokenizer_config.json's eos_token (SmolLM2's <|im_end|>), which
    # may differ from the token the run packed documents with; llama.cpp stops at the file's EOS.
    end_of_turn = tokenizer.settings.get("eos_token")
    writer.add_eos_token_id(vocab["tokens"].index(end_of_turn) if end_of_turn in vocab["tokens"] else tokenizer.eos_id)
    # Texts start with BOS where the run's documents did (Gemma's <bos>, from init_from's tokenizer).
    writer.add_bos_token_id(tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id)
    writer.add_add_bos_token(tokenizer.bos_id is not None)
    template = tokenizer.settings.get("chat_template")  # the run's, from init_from's tokenizer
    if isinstance(template, str):
        writer.add_chat_template(template)
    for name, array in _gguf_tensors(model, hf, layout):
        _add_tensor(writer, name, array, dtype)
    if hf.get("rope_scaling") is not None:
        writer.add_tensor(ROPE_FACTORS, _rope_factors(model))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def _layout(layout: GGUFLayout | None, hf: dict[str, Any]) -> GGUFLayout:
    """The model's GGUF layout; ValueError for what GGUF export cannot write."""
    if layout is None:
        raise ValueError(f"GGUF export: axtorch has no GGUF layout for HF model_type={hf['model_type']!r}")
    refusal = layout.refuses(hf)
    if refusal is not None:
        raise ValueError(f"GGUF export: llama.cpp's {layout.architecture} cannot express {refusal}")
    scaling = hf.get("rope_scaling")
    if scaling is not None and not (layout.interleaved_qk and _is_released_llama3(scaling)):
        raise ValueError(
            f"GGUF export writes unscaled RoPE and Llama 3's released settings only; this model has "
            f"rope_scaling={scaling}"
        )
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("GGUF export takes no attention biases on all four projections, nor MLP biases")
    return layout


def _add_metadata(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_float32(key, float(value))


def _is_released_llama3(scaling: dict[str, Any]) -> bool:
    band = (
        scaling.get("low_freq_factor"),
        scaling.get("high_freq_factor"),
        scaling.get("original_max_position_embeddings"),
    )
    return scaling.get("rope_type") == "llama3" and band in LLAMA3_ROPE_BANDS


def _rope_factors(model: CausalLM) -> np.ndarray:
    """Llama 3's per-pair frequency divisors, stored as llama.cpp's ``rope_freqs.weight``."""
    position = model.config.decoder.layer.attention.position
    assert isinstance(position, RotaryEmbeddingConfig)  # a scaled RoPE is what brought us here
    head_dim = model.config.decoder.layer.attention.resolved_head_dim(model.config.dim)
    return rope_divisors(position, head_dim).float().numpy()


def _tokenizer_fields(tokenizer: Tokenizer, vocab_size: int) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` fields for a byte-level BPE tokenizer, or the SentencePiece BPE one
    that ``from_gguf`` rebuilds (byte fallback: Llama 2, Gemma), padded to the model's vocabulary."""
    description = tokenizer.description()
    model, pre = description["model"], description.get("pre_tokenizer")
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return _sentencepiece_fields(description, vocab_size)
    if model.get("type") != "BPE" or description.get("normalizer") is not None:
        raise ValueError(
            "GGUF export takes a byte-level BPE tokenizer without a normalizer, or a SentencePiece BPE one"
        )
    tokens, types = _token_table(description, vocab_size)
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model["merges"]]
    name = _pre_tokenizer_name(pre)
    if bool(model.get("ignore_merges")) != (name in IGNORE_MERGES):
        # A GGUF cannot say it: llama.cpp decides by the pre-tokenizer's name.
        raise ValueError(
            f"the tokenizer's BPE has ignore_merges={bool(model.get('ignore_merges'))}, but llama.cpp applies "
            f"ignore_merges={name in IGNORE_MERGES} after pre-tokenizer {name!r}, so it would tokenize otherwise"
        )
    return {"model": BYTE_LEVEL_BPE_TOKENIZER, "pre": name, "tokens": tokens, "types": types, "merges": merges}


def _sentencepiece_fields(description: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """A SentencePiece vocabulary as llama.cpp's ``llama`` tokenizer reads it: pieces, types, scores.

    The original scores are gone; what the rebuilt merges (and llama.cpp's SentencePiece BPE)
    depend on is only their order, so a piece scores minus the rank of the first merge that
    makes it, and ``sentencepiece_vocab`` rebuilds the same merges in the same order.
    """
    from gguf import TokenType

    model = description["model"]
    normalizers = (description.get("normalizer") or {}).get("normalizers", [])
    if [n["type"] for n in normalizers] not in (["Replace"], ["Prepend", "Replace"]):
        raise ValueError(f"GGUF export: a SentencePiece tokenizer normalises with {normalizers}, not as it rebuilds")
    tokens, types = _token_table(description, vocab_size)
    first_merge: dict[str, int] = {}
    for rank, merge in enumerate(model["merges"]):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        first_merge.setdefault(left + right, rank)
    for index, token in enumerate(tokens):
        if token == model.get("unk_token"):
            types[index] = TokenType.UNKNOWN
        elif types[index] == TokenType.NORMAL and _BYTE_PIECE.fullmatch(token):
            types[index] = TokenType.BYTE
    scores = [-float(first_merge.get(token, 0)) for token in tokens]
    prefix = normalizers[0]["type"] == "Prepend"
    return {
        "model": SENTENCEPIECE_TOKENIZER,
        "tokens": tokens,
        "types": types,
        "scores": scores,
        "add_space_prefix": prefix,
    }


def _token_table(description: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens by id and their GGUF types (added special: CONTROL, other added: USER_DEFINED), padded
    with ``[PADn]`` tokens of type UNUSED to ``vocab_size``."""
    from gguf import TokenType

    ids = dict(description["model"]["vocab"])
    specials = {}
    for added in description.get("added_tokens", []):
        ids[added["content"]] = added["id"]
        specials[added["id"]] = added["special"]
    if len(ids) > vocab_size or max(ids.values()) >= vocab_size:
        raise ValueError(
            f"the tokenizer has ids up to {max(ids.values())}, beyond the model's vocabulary of {vocab_size}"
        )
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(TokenType.UNUSED)] * vocab_size
    for token, index in ids.items():
        tokens[index] = token
        kind = (
            TokenType.NORMAL
            if index not in specials
            else TokenType.CONTROL
            if specials[index]
            else TokenType.USER_DEFINED
        )
        types[index] = int(kind)
    return tokens, types


def _pre_tokenizer_name(pre: dict[str, Any] | None) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` whose rebuilt pre-tokenizer is this one, exactly."""
    for name, make in PRE_TOKENIZERS.items():
        probe = tokenizers.Tokenizer(models.BPE())
        probe.pre_tokenizer = make()
        if json.loads(probe.to_str())["pre_tokenizer"] == pre:
            return name
    raise ValueError(
        f"GGUF export has no llama.cpp pre-tokenizer for {json.dumps(pre)}; it writes {', '.join(PRE_TOKENIZERS)}"
    )


def _gguf_tensors(model: CausalLM, hf: dict[str, Any], layout: GGUFLayout) -> Iterator[tuple[str, np.ndarray]]:
    """GGUF-named float32 arrays in llama.cpp's layout (axtorch's norm weights are what llama.cpp stores)."""
    interleaved = layout.interleaved_qk
    gguf_names = {**_GGUF_NAMES, **{hf: gguf for gguf, hf in layout.layer_names}}
    for name, tensor in axtorch_to_hf_state_dict(model.state_dict(), layout.hf_names).items():
        values = tensor.detach().to(device="cpu", dtype=torch.float32)
        stem, _, suffix = name.rpartition(".")
        if name.startswith("model.layers.") and name.split(".", 3)[3] in gguf_names:  # stacked experts
            _, _, index, module = name.split(".", 3)
            gguf_name = f"blk.{index}.{gguf_names[module]}.weight"
        elif stem.startswith("model.layers."):
            _, _, index, module = stem.split(".", 3)
            gguf_name = f"blk.{index}.{gguf_names[module]}.{suffix}"
            if gguf_names[module] == SHARED_EXPERT_GATE:
                values = values.flatten()
        else:
            gguf_name = f"{_GLOBAL_GGUF_NAMES[stem]}.{suffix}"
        if interleaved and stem.endswith("q_proj"):
            values = interleaved_from_halves(values, hf["num_attention_heads"])
        elif interleaved and stem.endswith("k_proj"):
            values = interleaved_from_halves(values, hf["num_key_value_heads"])
        yield gguf_name, values.contiguous().numpy()


def _add_tensor(writer: Any, name: str, array: np.ndarray, dtype: str) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    kind = GGMLQuantizationType[dtype.upper()]
    if array.ndim < 2 or dtype == "f32":
        writer.add_tensor(name, array)
    elif dtype == "f16" or array.shape[-1] % GGML_QUANT_SIZES[kind][0]:
        writer.add_tensor(name, array.astype(np.float16))  # also rows that the format's blocks do not divide
    else:
        writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
