"""Hugging Face Llama <-> axtorch: config mapping and parameter names.

axtorch uses HF's weight layouts ([out, in] projections, rotate-half RoPE), so conversion is a
renaming with no tensor surgery.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from axtorch.layers.attention import AttentionConfig
from axtorch.layers.attention_mask import CausalMaskConfig
from axtorch.layers.feed_forward import Activation, GatedFeedForwardConfig
from axtorch.layers.linear import LinearConfig
from axtorch.layers.norm import RMSNormConfig
from axtorch.layers.position import RotaryEmbeddingConfig
from axtorch.layers.transformer import DecoderConfig, TransformerLayerConfig
from axtorch.models.causal_lm import CausalLMConfig

#: (HF name pattern, axtorch name pattern); ``{i}`` is the layer index.
_LAYER_NAMES = [
    ("model.layers.{i}.self_attn.q_proj", "decoder.layers.{i}.attention.q_proj"),
    ("model.layers.{i}.self_attn.k_proj", "decoder.layers.{i}.attention.k_proj"),
    ("model.layers.{i}.self_attn.v_proj", "decoder.layers.{i}.attention.v_proj"),
    ("model.layers.{i}.self_attn.o_proj", "decoder.layers.{i}.attention.o_proj"),
    ("model.layers.{i}.mlp.gate_proj", "decoder.layers.{i}.feed_forward.gate_proj"),
    ("model.layers.{i}.mlp.up_proj", "decoder.layers.{i}.feed_forward.up_proj"),
    ("model.layers.{i}.mlp.down_proj", "decoder.layers.{i}.feed_forward.down_proj"),
    ("model.layers.{i}.input_layernorm", "decoder.layers.{i}.attention_norm"),
    ("model.layers.{i}.post_attention_layernorm", "decoder.layers.{i}.feed_forward_norm"),
]
_GLOBAL_NAMES = [
    ("model.embed_tokens", "embedding"),
    ("model.norm", "decoder.final_norm"),
    ("lm_head", "lm_head"),
]


def _name_pairs() -> list[tuple[re.Pattern, str]]:
    pairs = []
    for hf, ours in _LAYER_NAMES:
        pairs.append((re.compile(re.escape(hf).replace(r"\{i\}", r"(\d+)") + r"\.(weight|bias)$"), ours))
    for hf, ours in _GLOBAL_NAMES:
        pairs.append((re.compile(re.escape(hf) + r"\.(weight|bias)$"), ours))
    return pairs


_PAIRS = _name_pairs()


def hf_to_axtorch_name(name: str) -> str:
    for pattern, ours in _PAIRS:
        match = pattern.match(name)
        if match:
            *layer, suffix = match.groups()
            return ours.format(i=layer[0]) + "." + suffix if layer else f"{ours}.{suffix}"
    raise KeyError(f"no axtorch parameter corresponds to HF parameter {name!r}")


def hf_to_axtorch_state_dict(state: Mapping[str, torch.Tensor], tie_embeddings: bool) -> dict[str, torch.Tensor]:
    converted = {}
    for name, tensor in state.items():
        if name.endswith("rotary_emb.inv_freq") or (tie_embeddings and name == "lm_head.weight"):
            continue
        converted[hf_to_axtorch_name(name)] = tensor
    return converted


def llama_config_from_hf(hf: Mapping[str, Any] | Any) -> CausalLMConfig:
    """An axtorch config equal in function to a HF ``LlamaConfig`` (object or ``config.json`` dict)."""
    get = (lambda key, default=None: hf.get(key, default)) if isinstance(hf, Mapping) else (
        lambda key, default=None: getattr(hf, key, default)
    )
    rope_theta = get("rope_theta") or (get("rope_parameters") or {}).get("rope_theta", 10000.0)
    bias = bool(get("attention_bias", False))
    return CausalLMConfig(
        vocab_size=get("vocab_size"),
        dim=get("hidden_size"),
        max_seq_len=get("max_position_embeddings", 2048),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        decoder=DecoderConfig(
            num_layers=get("num_hidden_layers"),
            layer=TransformerLayerConfig(
                attention=AttentionConfig(
                    num_heads=get("num_attention_heads"),
                    num_kv_heads=get("num_key_value_heads") or get("num_attention_heads"),
                    head_dim=get("head_dim"),
                    qkv_projection=LinearConfig(bias=bias),
                    output_projection=LinearConfig(bias=bias),
                    position=RotaryEmbeddingConfig(theta=float(rope_theta)),
                    mask=CausalMaskConfig(),
                ),
                feed_forward=GatedFeedForwardConfig(
                    hidden_dim=get("intermediate_size"), activation=Activation(get("hidden_act", "silu"))
                ),
                norm=RMSNormConfig(eps=get("rms_norm_eps", 1e-6)),
            ),
        ),
    )
