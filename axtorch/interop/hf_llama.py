"""Hugging Face Llama-family <-> axtorch: config mapping, parameter names, model assembly.

axtorch uses HF's weight layouts ([out, in] projections, rotate-half RoPE), so conversion is a
renaming with no tensor surgery. Llama, Mistral, Qwen2 and Qwen3 share the architecture and
parameter names; they differ only in config fields (biases, sliding window, QK-norm, RoPE
scaling), mapped here. Mixtral and Qwen3-MoE are Mistral and Qwen3 with a mixture of experts as
every layer's MLP; what is particular to their experts lives in ``hf_moe``. A config field that
axtorch cannot honour raises ``ValueError`` naming it: a silently different model is worse than
no model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from axtorch.interop.assembly import model_from_state_dict
from axtorch.interop.hf_moe import (
    MOE_ARCHITECTURES,
    MOE_MODEL_TYPES,
    MOE_NAMES,
    expert_tensors_from_hf,
    expert_tensors_to_hf,
    is_mixture_of_experts,
    mixture_of_experts_from_hf,
    mixture_of_experts_to_hf,
)
from axtorch.layers.attention import AttentionConfig
from axtorch.layers.attention_kernel import SdpaKernelConfig
from axtorch.layers.attention_mask import CausalMaskConfig, MaskConfig, SlidingWindowMaskConfig
from axtorch.layers.feed_forward import Activation, GatedFeedForwardConfig
from axtorch.layers.linear import LinearConfig
from axtorch.layers.norm import RMSNormConfig
from axtorch.layers.position import (
    LinearScaledRotaryEmbeddingConfig,
    Llama3RotaryEmbeddingConfig,
    RotaryEmbeddingConfig,
    YarnRotaryEmbeddingConfig,
)
from axtorch.layers.residual import PreNormResidualConfig
from axtorch.layers.transformer import DecoderConfig, TransformerLayerConfig
from axtorch.models.causal_lm import CausalLM, CausalLMConfig

#: HF ``model_type`` values whose models are this architecture (given the checks below).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)

#: HF ``rope_type`` -> (axtorch config, the HF keys it requires). The configs' other fields are
#: named as HF's keys are; ``theta`` is HF's ``rope_theta``.
_ROPE_TYPES: dict[str, tuple[type[RotaryEmbeddingConfig], tuple[str, ...]]] = {
    "default": (RotaryEmbeddingConfig, ()),
    "llama3": (Llama3RotaryEmbeddingConfig, ("factor", "low_freq_factor", "high_freq_factor")),
    "linear": (LinearScaledRotaryEmbeddingConfig, ("factor",)),
    "yarn": (YarnRotaryEmbeddingConfig, ()),
}

#: HF ``hidden_act`` <-> axtorch activation, for the functions that compute the same thing.
_ACTIVATIONS = {
    "silu": Activation.silu,
    "gelu": Activation.gelu,
    "gelu_pytorch_tanh": Activation.gelu_tanh,
    "relu": Activation.relu,
}

#: (HF name template, axtorch name template); ``{i}`` is the layer index. Names end in ``.weight`` or
#: ``.bias``, except stacked expert tensors (see ``hf_moe``), which have no suffix.
_NAMES = [
    ("model.layers.{i}.self_attn.q_proj", "decoder.layers.{i}.attention.q_proj"),
    ("model.layers.{i}.self_attn.k_proj", "decoder.layers.{i}.attention.k_proj"),
    ("model.layers.{i}.self_attn.v_proj", "decoder.layers.{i}.attention.v_proj"),
    ("model.layers.{i}.self_attn.o_proj", "decoder.layers.{i}.attention.o_proj"),
    ("model.layers.{i}.self_attn.q_norm", "decoder.layers.{i}.attention.query_norm"),
    ("model.layers.{i}.self_attn.k_norm", "decoder.layers.{i}.attention.key_norm"),
    ("model.layers.{i}.mlp.gate_proj", "decoder.layers.{i}.feed_forward.gate_proj"),
    ("model.layers.{i}.mlp.up_proj", "decoder.layers.{i}.feed_forward.up_proj"),
    ("model.layers.{i}.mlp.down_proj", "decoder.layers.{i}.feed_forward.down_proj"),
    ("model.layers.{i}.input_layernorm", "decoder.layers.{i}.attention_norm"),
    ("model.layers.{i}.post_attention_layernorm", "decoder.layers.{i}.feed_forward_norm"),
    ("model.embed_tokens", "embedding"),
    ("model.norm", "decoder.final_norm"),
    ("lm_head", "lm_head"),
    *MOE_NAMES,
]


def _name_pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + r"(?P<suffix>\.weight|\.bias|)$")


_HF_TO_AXTORCH = [(_name_pattern(hf), ours) for hf, ours in _NAMES]
_AXTORCH_TO_HF = [(_name_pattern(ours), hf) for hf, ours in _NAMES]


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, target in table:
        match = pattern.match(name)
        if match:
            return f"{target.format(i=match.groupdict().get('i'))}{match['suffix']}"
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


def axtorch_to_hf_state_dict(state: Mapping[str, torch.Tensor], model_type: str = "llama") -> dict[str, torch.Tensor]:
    """Rename axtorch tensors to HF's names: the inverse of ``hf_to_axtorch_state_dict``.

    A mixture of experts' stacked tensors become ``model_type``'s per-expert tensors (views).
    """
    renamed = ((axtorch_to_hf_name(name), tensor) for name, tensor in state.items())
    return dict(expert_tensors_to_hf(renamed, model_type))


def llama_model_from_hf_tensors(
    config: CausalLMConfig, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> CausalLM:
    """Build ``config`` around HF-named ``tensors`` cast to ``dtype`` (lazily: see ``model_from_state_dict``)."""
    cast = ((name, tensor.to(dtype)) for name, tensor in tensors)
    stacked = expert_tensors_from_hf(cast, config.decoder.layer.feed_forward)
    state = hf_to_axtorch_state_dict(stacked, config.tie_embeddings)
    return model_from_state_dict(config, state)


def _getter(hf: Mapping[str, Any] | Any) -> Callable[..., Any]:
    if isinstance(hf, Mapping):
        return lambda key, default=None: hf.get(key, default)
    return lambda key, default=None: getattr(hf, key, default)


def _position_config(get: Callable[..., Any]) -> RotaryEmbeddingConfig:
    """The RoPE config for HF's ``rope_scaling`` (older files) or ``rope_parameters`` (transformers 5)."""
    source = "rope_scaling" if get("rope_scaling") else "rope_parameters"
    settings = dict(get(source) or {})
    rope_type = settings.get("rope_type") or settings.get("type") or "default"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"HF config {source}.rope_type={rope_type!r} is not supported; supported: {sorted(_ROPE_TYPES)}"
        )
    partial_rotary_factor = settings.get("partial_rotary_factor") or get("partial_rotary_factor") or 1.0
    if partial_rotary_factor != 1.0:
        raise ValueError(
            f"HF config partial_rotary_factor={partial_rotary_factor!r} is not supported: RoPE must rotate whole heads"
        )
    if settings.get("attention_factor") is None and settings.get("mscale") and settings.get("mscale_all_dim"):
        raise ValueError(
            f"HF config {source}.mscale / mscale_all_dim (DeepSeek's YaRN attention factor) is not supported"
        )
    config_class, required = _ROPE_TYPES[rope_type]
    missing = [key for key in required if settings.get(key) is None]
    if missing:
        raise ValueError(f"HF config {source} with rope_type={rope_type!r} lacks {missing}")
    # As HF: a top-level original_max_position_embeddings wins, then the RoPE settings', then
    # max_position_embeddings; YaRN's factor defaults to the context extension ratio.
    max_length = get("max_position_embeddings", 2048)
    settings["original_max_position_embeddings"] = (
        get("original_max_position_embeddings") or settings.get("original_max_position_embeddings") or max_length
    )
    if rope_type == "yarn" and settings.get("factor") is None:
        settings["factor"] = max_length / settings["original_max_position_embeddings"]
    values = {
        field.name: settings[field.name]
        for field in dataclasses.fields(config_class)
        if field.name != "theta" and settings.get(field.name) is not None
    }
    theta = float(settings.get("rope_theta") or get("rope_theta") or 10000.0)
    return config_class(theta=theta, **values)


def _rope_to_hf(position: RotaryEmbeddingConfig) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` in the form both transformers 4 and 5 read."""
    rope_type = next(name for name, (cls, _) in _ROPE_TYPES.items() if cls is type(position))
    scaling = {
        field.name: getattr(position, field.name) for field in dataclasses.fields(position) if field.name != "theta"
    }
    scaling = {key: value for key, value in scaling.items() if value is not None}
    return {"rope_theta": position.theta, "rope_scaling": {"rope_type": rope_type, **scaling} if scaling else None}


def _mask_config(get: Callable[..., Any], model_type: str) -> MaskConfig:
    """Causal, or a sliding window when the HF model uses the same window in every layer."""
    num_layers = get("num_hidden_layers")
    layer_types = get("layer_types")
    if model_type == "mistral":
        window = get("sliding_window", 4096)  # MistralConfig's default when the field is absent
    elif model_type in ("qwen2", "qwen3"):
        # Qwen carries a window size but uses it only when use_sliding_window is set, and then only
        # from layer max_window_layers on.
        window = get("sliding_window", 4096) if get("use_sliding_window", False) else None
        if layer_types is None:
            first_sliding = get("max_window_layers", 28) if window is not None else num_layers
            layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    elif model_type == "qwen3_moe":  # unlike Qwen3, every layer slides when use_sliding_window is set
        window = get("sliding_window", 4096) if get("use_sliding_window", False) else None
    else:
        window = get("sliding_window")
        if window is not None and model_type != "mixtral":
            raise ValueError(f"HF config sliding_window={window!r} is not supported for model_type={model_type!r}")
    kinds = set(layer_types or ["sliding_attention" if window is not None else "full_attention"])
    unknown = sorted(kinds - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"HF config layer_types containing {unknown} is not supported: only full or sliding attention")
    if len(kinds) > 1:
        raise ValueError(
            "HF config layer_types mixing full_attention and sliding_attention is not supported: "
            "all axtorch layers share one attention mask"
        )
    if kinds == {"sliding_attention"} and window is not None:
        return SlidingWindowMaskConfig(window=window)
    return CausalMaskConfig()


def llama_config_from_hf(hf: Mapping[str, Any] | Any) -> CausalLMConfig:
    """An axtorch config equal in function to a HF config (object or ``config.json`` dict) of a supported type.

    The types are Llama, Mistral, Qwen2, Qwen3, Mixtral and Qwen3-MoE (``SUPPORTED_MODEL_TYPES``).
    """
    get = _getter(hf)
    model_type = get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"HF config model_type={model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    if get("quantization_config") is not None:
        raise ValueError("HF config quantization_config is set: quantized checkpoints are not supported")
    position = _position_config(get)
    mask = _mask_config(get, model_type)
    hidden_act = get("hidden_act", "silu")
    if hidden_act not in _ACTIVATIONS:
        raise ValueError(f"HF config hidden_act={hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    attention_bias = bool(get("attention_bias", False))
    # Qwen2 has biases on the q/k/v projections only; Llama's attention_bias covers all four.
    qkv_bias, output_bias = (True, False) if model_type == "qwen2" else (attention_bias, attention_bias)
    mlp_bias = bool(get("mlp_bias", False))
    norm_eps = get("rms_norm_eps", 1e-6)
    # Qwen3 normalises each head's queries and keys; its head_dim defaults to 128, not dim / heads
    # (Qwen3-MoE's to dim / heads).
    qk_norm = RMSNormConfig(eps=norm_eps) if model_type in ("qwen3", "qwen3_moe") else None
    head_dim = get("head_dim", 128 if model_type == "qwen3" else None)
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
                    head_dim=head_dim,
                    dropout=float(get("attention_dropout", 0.0)),
                    qkv_projection=LinearConfig(bias=qkv_bias),
                    output_projection=LinearConfig(bias=output_bias),
                    query_norm=qk_norm,
                    key_norm=qk_norm,
                    position=position,
                    mask=mask,
                ),
                feed_forward=mixture_of_experts_from_hf(get, model_type, _ACTIVATIONS[hidden_act])
                if model_type in MOE_MODEL_TYPES
                else GatedFeedForwardConfig(
                    hidden_dim=get("intermediate_size"),
                    activation=_ACTIVATIONS[hidden_act],
                    projection=LinearConfig(bias=mlp_bias),
                    output_projection=LinearConfig(bias=mlp_bias),
                ),
                norm=RMSNormConfig(eps=norm_eps),
                residual=PreNormResidualConfig(),
            ),
        ),
    )


#: HF family -> its ``architectures`` entry, for the families ``llama_config_to_hf`` writes.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **MOE_ARCHITECTURES,
}


def _require(condition: bool, feature: str) -> None:
    if not condition:
        raise ValueError(
            f"no HF family that to_hf writes ({', '.join(_ARCHITECTURES)}) can express this model: {feature}"
        )


def llama_family(config: CausalLMConfig) -> str:
    """The simplest HF family with the model's features: QK-norm needs Qwen3, a sliding window Mistral.

    A mixture of experts needs Mixtral, or Qwen3-MoE with QK-norm.
    """
    attention = config.decoder.layer.attention
    qk_norm = attention.query_norm is not None or attention.key_norm is not None
    if is_mixture_of_experts(config):
        return "qwen3_moe" if qk_norm else "mixtral"
    if qk_norm:
        return "qwen3"
    return "mistral" if type(attention.mask) is SlidingWindowMaskConfig else "llama"


def llama_config_to_hf(config: CausalLMConfig) -> dict[str, Any]:
    """A ``config.json`` dict for ``config`` as a HF Llama, Mistral, Qwen3, Mixtral or Qwen3-MoE model.

    Llama unless the model needs more: Mistral for a sliding window, Qwen3 for QK-norm (with a
    sliding window too, on every layer), Mixtral or Qwen3-MoE (with QK-norm) for a mixture of
    experts. ``ValueError`` if none of them can express the model.
    Only exact config types are accepted: a subclass may compute something else.
    """
    layer = config.decoder.layer
    attention, feed_forward, norm = layer.attention, layer.feed_forward, layer.norm
    final_norm = config.decoder.final_norm or norm
    family = llama_family(config)
    _require(type(norm) is RMSNormConfig, f"layer norm {type(norm).__name__} (they use RMSNorm)")
    _require(
        type(final_norm) is RMSNormConfig and final_norm.eps == norm.eps,
        f"final norm {final_norm} differs from the layer norm {norm} (they have one rms_norm_eps)",
    )
    position = attention.position
    _require(
        any(type(position) is cls for cls, _ in _ROPE_TYPES.values()),
        f"position encoding {type(position).__name__} (they use RoPE: {sorted(_ROPE_TYPES)})",
    )
    assert isinstance(position, RotaryEmbeddingConfig)  # every class of _ROPE_TYPES is one
    _require(
        type(attention.mask) in (CausalMaskConfig, SlidingWindowMaskConfig),
        f"attention mask {type(attention.mask).__name__}",
    )
    if family in ("qwen3", "qwen3_moe"):
        _require(
            all(type(n) is RMSNormConfig and n.eps == norm.eps for n in (attention.query_norm, attention.key_norm)),
            f"query/key norms {attention.query_norm} and {attention.key_norm} (Qwen3 has RMSNorms on both, "
            f"with the layer norm's eps {norm.eps})",
        )
    _require(
        type(feed_forward) is GatedFeedForwardConfig or family in MOE_MODEL_TYPES,
        f"feed-forward {type(feed_forward).__name__} (they use a gated MLP or a mixture of gated MLPs)",
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
    _require(
        family == "llama" or not feed_forward.projection.bias,
        f"feed-forward biases with a {family} model (only Llama has mlp_bias)",
    )
    _require(
        family != "mistral" or not attention.qkv_projection.bias,
        "attention biases with a sliding window (Mistral has no attention_bias)",
    )
    _require(config.tie_embeddings or not config.lm_head.bias, "a bias on the output head")
    _require(config.position_embedding is None, "absolute position embeddings (they have only RoPE)")
    _require(
        config.embedding.multiplier == 1.0 and not config.embedding.scale_by_sqrt_dim,
        "scaled token embeddings (multiplier or scale_by_sqrt_dim)",
    )
    _require(config.embedding_dropout == 0.0, f"embedding_dropout={config.embedding_dropout} (they have none)")
    _require(
        layer.residual is None or (type(layer.residual) is PreNormResidualConfig and layer.residual.dropout == 0.0),
        f"norm placement {layer.residual} (they are pre-norm, without residual dropout)",
    )
    _require(
        attention.softmax_scale is None and type(attention.kernel) in (type(None), SdpaKernelConfig),
        f"attention softmax_scale={attention.softmax_scale}, kernel={type(attention.kernel).__name__} "
        "(they scale by 1/sqrt(head_dim) and do not cap)",
    )
    window = attention.mask.window if type(attention.mask) is SlidingWindowMaskConfig else None
    family_fields: dict[str, dict[str, Any]] = {
        "llama": {"attention_bias": attention.qkv_projection.bias, "mlp_bias": feed_forward.projection.bias},
        "mistral": {"sliding_window": window},
        "qwen3": {
            "attention_bias": attention.qkv_projection.bias,
            "use_sliding_window": window is not None,
            "sliding_window": window,
            # Qwen3 slides from layer max_window_layers on: from the first layer, or never.
            "max_window_layers": 0 if window is not None else config.decoder.num_layers,
        },
        "mixtral": {"sliding_window": window},
        "qwen3_moe": {
            "attention_bias": attention.qkv_projection.bias,
            "use_sliding_window": window is not None,
            "sliding_window": window,
        },
    }
    experts = mixture_of_experts_to_hf(config, family) if family in MOE_MODEL_TYPES else {}
    return {
        "architectures": [_ARCHITECTURES[family]],
        "model_type": family,
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
        **_rope_to_hf(position),
        "attention_dropout": attention.dropout,
        **family_fields[family],
        **experts,
        "tie_word_embeddings": config.tie_embeddings,
    }
