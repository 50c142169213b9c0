"""Hugging Face Llama-family <-> axtorch: config mapping, parameter names, model assembly.

axtorch uses HF's weight layouts ([out, in] projections, rotate-half RoPE), so conversion is a
renaming with no tensor surgery. Llama, Mistral (without sliding window) and Qwen2 share the
architecture and parameter names; they differ only in config fields, mapped here. A config field
that axtorch cannot honour raises ``ValueError`` naming it: a silently different model is worse
than no model.
"""

from __future__ import annotations

import re
from itertools import chain
from typing import Any, Callable, Iterable, Mapping

import torch

from axtorch.layers.attention import AttentionConfig
from axtorch.layers.attention_mask import CausalMaskConfig
from axtorch.layers.feed_forward import Activation, GatedFeedForwardConfig
from axtorch.layers.linear import LinearConfig
from axtorch.layers.norm import RMSNormConfig
from axtorch.layers.position import RotaryEmbeddingConfig
from axtorch.layers.transformer import DecoderConfig, TransformerLayerConfig
from axtorch.models.causal_lm import CausalLM, CausalLMConfig

#: HF ``model_type`` values whose models are this architecture (given the checks below).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

#: HF ``hidden_act`` <-> axtorch activation, for the functions that compute the same thing.
_ACTIVATIONS = {
    "silu": Activation.silu,
    "gelu": Activation.gelu,
    "gelu_pytorch_tanh": Activation.gelu_tanh,
    "relu": Activation.relu,
}

#: (HF name template, axtorch name template); ``{i}`` is the layer index.
_NAMES = [
    ("model.layers.{i}.self_attn.q_proj", "decoder.layers.{i}.attention.q_proj"),
    ("model.layers.{i}.self_attn.k_proj", "decoder.layers.{i}.attention.k_proj"),
    ("model.layers.{i}.self_attn.v_proj", "decoder.layers.{i}.attention.v_proj"),
    ("model.layers.{i}.self_attn.o_proj", "decoder.layers.{i}.attention.o_proj"),
    ("model.layers.{i}.mlp.gate_proj", "decoder.layers.{i}.feed_forward.gate_proj"),
    ("model.layers.{i}.mlp.up_proj", "decoder.layers.{i}.feed_forward.up_proj"),
    ("model.layers.{i}.mlp.down_proj", "decoder.layers.{i}.feed_forward.down_proj"),
    ("model.layers.{i}.input_layernorm", "decoder.layers.{i}.attention_norm"),
    ("model.layers.{i}.post_attention_layernorm", "decoder.layers.{i}.feed_forward_norm"),
    ("model.embed_tokens", "embedding"),
    ("model.norm", "decoder.final_norm"),
    ("lm_head", "lm_head"),
]


def _name_pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + r"\.(?P<suffix>weight|bias)$")


_HF_TO_AXTORCH = [(_name_pattern(hf), ours) for hf, ours in _NAMES]
_AXTORCH_TO_HF = [(_name_pattern(ours), hf) for hf, ours in _NAMES]


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, target in table:
        match = pattern.match(name)
        if match:
            return f"{target.format(i=match.groupdict().get('i'))}.{match['suffix']}"
    return None


def hf_to_axtorch_name(name: str) -> str:
    ours = _rename(name, _HF_TO_AXTORCH)
    if ours is None:
        raise KeyError(f"no axtorch parameter corresponds to HF parameter {name!r}")
    return ours


def axtorch_to_hf_name(name: str) -> str:
    hf = _rename(name, _AXTORCH_TO_HF)
    if hf is None:
        raise KeyError(f"no HF Llama parameter corresponds to axtorch parameter {name!r}")
    return hf


def hf_to_axtorch_state_dict(
    state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], tie_embeddings: bool
) -> dict[str, torch.Tensor]:
    """Rename HF tensors; drops RoPE caches and, when tied, the (redundant) ``lm_head.weight``."""
    items = state.items() if isinstance(state, Mapping) else state
    converted = {}
    for name, tensor in items:
        if name.endswith("rotary_emb.inv_freq") or (tie_embeddings and name == "lm_head.weight"):
            continue
        converted[hf_to_axtorch_name(name)] = tensor
    return converted


def llama_model_from_hf_tensors(
    config: CausalLMConfig, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> CausalLM:
    """Build ``config`` on the meta device and adopt HF-named ``tensors`` cast to ``dtype``.

    ``assign=True`` makes the tensors the parameters, so weights are never held twice; pass a
    lazy iterable and each checkpoint-dtype tensor is freed once its cast copy exists.
    """
    with torch.device("meta"):
        model = config.build()
    state = hf_to_axtorch_state_dict(((name, tensor.to(dtype)) for name, tensor in tensors), config.tie_embeddings)
    model.load_state_dict(state, strict=True, assign=True)
    unloaded = [name for name, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if unloaded:
        raise RuntimeError(f"no checkpoint tensor for {unloaded} (left on the meta device)")
    return model


def _getter(hf: Mapping[str, Any] | Any) -> Callable[..., Any]:
    if isinstance(hf, Mapping):
        return lambda key, default=None: hf.get(key, default)
    return lambda key, default=None: getattr(hf, key, default)


def _rope_theta(get: Callable[..., Any]) -> float:
    """The RoPE base; raises for any RoPE variant but the default one."""
    for field in ("rope_parameters", "rope_scaling"):
        settings = get(field) or {}
        rope_type = settings.get("rope_type") or settings.get("type") or "default"
        if rope_type != "default":
            raise ValueError(
                f"HF config {field}.rope_type={rope_type!r} is not supported: axtorch's RotaryEmbedding "
                "implements only default RoPE (no frequency scaling)"
            )
    return float((get("rope_parameters") or {}).get("rope_theta") or get("rope_theta") or 10000.0)


def _check_full_attention(get: Callable[..., Any]) -> None:
    """Raise for sliding-window attention, which axtorch's causal mask cannot express."""
    # Qwen2 carries a window size but only uses it when use_sliding_window is set; others always do.
    if get("use_sliding_window", True) and get("sliding_window") is not None:
        raise ValueError(
            f"HF config sliding_window={get('sliding_window')!r} is not supported: axtorch has no "
            "sliding-window attention mask yet (only full causal attention)"
        )
    layer_types = get("layer_types") or []
    other = sorted(set(layer_types) - {"full_attention"})
    if other:
        raise ValueError(f"HF config layer_types containing {other} is not supported: only full_attention")


def llama_config_from_hf(hf: Mapping[str, Any] | Any) -> CausalLMConfig:
    """An axtorch config equal in function to a HF Llama/Mistral/Qwen2 config (object or ``config.json`` dict)."""
    get = _getter(hf)
    model_type = get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"HF config model_type={model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    if get("quantization_config") is not None:
        raise ValueError("HF config quantization_config is set: quantized checkpoints are not supported")
    rope_theta = _rope_theta(get)
    _check_full_attention(get)
    hidden_act = get("hidden_act", "silu")
    if hidden_act not in _ACTIVATIONS:
        raise ValueError(f"HF config hidden_act={hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    attention_bias = bool(get("attention_bias", False))
    # Qwen2 has biases on the q/k/v projections only; Llama's attention_bias covers all four.
    qkv_bias, output_bias = (True, False) if model_type == "qwen2" else (attention_bias, attention_bias)
    mlp_bias = bool(get("mlp_bias", False))
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
                    dropout=float(get("attention_dropout", 0.0)),
                    qkv_projection=LinearConfig(bias=qkv_bias),
                    output_projection=LinearConfig(bias=output_bias),
                    position=RotaryEmbeddingConfig(theta=rope_theta),
                    mask=CausalMaskConfig(),
                ),
                feed_forward=GatedFeedForwardConfig(
                    hidden_dim=get("intermediate_size"),
                    activation=_ACTIVATIONS[hidden_act],
                    projection=LinearConfig(bias=mlp_bias),
                    output_projection=LinearConfig(bias=mlp_bias),
                ),
                norm=RMSNormConfig(eps=get("rms_norm_eps", 1e-6)),
            ),
        ),
    )


def _require(condition: bool, feature: str) -> None:
    if not condition:
        raise ValueError(f"HF Llama cannot express this model: {feature}")


def llama_config_to_hf(config: CausalLMConfig) -> dict[str, Any]:
    """A ``LlamaForCausalLM`` ``config.json`` dict for ``config``; ``ValueError`` if Llama cannot express it.

    Only exact config types are accepted: a subclass may compute something else.
    """
    layer = config.decoder.layer
    attention, feed_forward, norm = layer.attention, layer.feed_forward, layer.norm
    final_norm = config.decoder.final_norm or norm
    _require(type(norm) is RMSNormConfig, f"layer norm {type(norm).__name__} (Llama uses RMSNorm)")
    _require(
        type(final_norm) is RMSNormConfig and final_norm.eps == norm.eps,
        f"final norm {final_norm} differs from the layer norm {norm} (Llama has one rms_norm_eps)",
    )
    _require(
        type(attention.position) is RotaryEmbeddingConfig,
        f"position encoding {type(attention.position).__name__} (Llama uses RoPE)",
    )
    _require(type(attention.mask) is CausalMaskConfig, f"attention mask {type(attention.mask).__name__}")
    _require(
        type(feed_forward) is GatedFeedForwardConfig,
        f"feed-forward {type(feed_forward).__name__} (Llama uses a gated MLP)",
    )
    hidden_act = {ours: hf for hf, ours in _ACTIVATIONS.items()}[feed_forward.activation]
    _require(
        attention.qkv_projection.bias == attention.output_projection.bias,
        "bias on the q/k/v projections but not the output one, or the reverse (attention_bias covers all four)",
    )
    _require(
        feed_forward.projection.bias == feed_forward.output_projection.bias,
        "bias on some feed-forward projections only (mlp_bias covers all three)",
    )
    _require(config.tie_embeddings or not config.lm_head.bias, "a bias on the output head")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": feed_forward.hidden_dim,
        "num_hidden_layers": config.decoder.num_layers,
        "num_attention_heads": attention.num_heads,
        "num_key_value_heads": attention.resolved_kv_heads(),
        "head_dim": attention.resolved_head_dim(config.dim),
        "hidden_act": hidden_act,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": norm.eps,
        "rope_theta": attention.position.theta,
        "rope_scaling": None,
        "attention_bias": attention.qkv_projection.bias,
        "attention_dropout": attention.dropout,
        "mlp_bias": feed_forward.projection.bias,
        "tie_word_embeddings": config.tie_embeddings,
    }
