"""The Llama layout that most HF families share, and the factory that makes a family of it.

Llama, Mistral, Qwen2, Qwen3 and their mixture-of-experts variants have the same modules and
parameter names and HF's weight layouts ([out, in] projections, rotate-half RoPE), so conversion
is a renaming with no tensor surgery. They differ in config fields (biases, sliding windows,
QK-norm, experts), which each family's file supplies to a ``LlamaLayout``. A field that
axtorch cannot honour raises ``ValueError`` naming it: a silently different model is worse than
no model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional

import torch

from axtorch.interop.families.experts import CANONICAL_EXPERT_NAMES, ExpertFormat, stack_experts, unstack_experts
from axtorch.interop.families.family import Family, Getter, GGUFLayout, NamedTensor, requirement
from axtorch.layers.attention import AttentionConfig
from axtorch.layers.attention_kernel import SdpaKernelConfig
from axtorch.layers.attention_mask import CausalMaskConfig, MaskConfig, SlidingWindowMaskConfig
from axtorch.layers.embedding import EmbeddingConfig
from axtorch.layers.feed_forward import Activation, FeedForwardConfig, GatedFeedForwardConfig
from axtorch.layers.linear import LinearConfig
from axtorch.layers.norm import RMSNormConfig
from axtorch.layers.relative_position import (
    LinearScaledRotaryEmbeddingConfig,
    Llama3RotaryEmbeddingConfig,
    RotaryEmbeddingConfig,
    YarnRotaryEmbeddingConfig,
)
from axtorch.layers.residual import PreNormResidualConfig
from axtorch.layers.transformer import DecoderConfig, TransformerLayerConfig
from axtorch.models.causal_lm import CausalLMConfig

#: HF ``rope_type`` -> (axtorch config, the HF keys it requires). The configs' other fields are
#: named as HF's keys are; ``theta`` is HF's ``rope_theta``.
ROPE_TYPES: dict[str, tuple[type[RotaryEmbeddingConfig], tuple[str, ...]]] = {
    "default": (RotaryEmbeddingConfig, ()),
    "llama3": (Llama3RotaryEmbeddingConfig, ("factor", "low_freq_factor", "high_freq_factor")),
    "linear": (LinearScaledRotaryEmbeddingConfig, ("factor",)),
    "yarn": (YarnRotaryEmbeddingConfig, ()),
}

#: HF ``hidden_act`` <-> axtorch activation, for the functions that compute the same thing.
ACTIVATIONS = {
    "silu": Activation.silu,
    "gelu": Activation.gelu,
    "gelu_pytorch_tanh": Activation.gelu_tanh,
    "relu": Activation.relu,
}

#: (HF name template, axtorch name template); ``{i}`` is the layer index. Names end in ``.weight`` or
#: ``.bias``, except stacked expert tensors (see ``experts``), which have no suffix.
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
    *CANONICAL_EXPERT_NAMES,
]


def _name_pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + r"(?P<suffix>\.weight|\.bias|)$")


_HF_TO_AXTORCH = [(_name_pattern(hf), ours) for hf, ours in _NAMES]
_AXTORCH_TO_HF = [(_name_pattern(ours), hf) for hf, ours in _NAMES]
#: A family's own (HF, axtorch) name templates, tried before the shared ones (``_NAMES``): Gemma 2's
#: ``post_attention_layernorm`` is the attention's post-norm, not the feed-forward's pre-norm.
NameTemplates = Sequence[tuple[str, str]]


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, target in table:
        match = pattern.match(name)
        if match:
            return f"{target.format(i=match.groupdict().get('i'))}{match['suffix']}"
    return None


def hf_to_axtorch_name(name: str, names: NameTemplates = ()) -> str:
    ours = _rename(name, [*((_name_pattern(hf), ours) for hf, ours in names), *_HF_TO_AXTORCH])
    if ours is None:
        raise KeyError(f"no axtorch parameter corresponds to HF parameter {name!r}")
    return ours


def axtorch_to_hf_name(name: str, names: NameTemplates = ()) -> str:
    hf = _rename(name, [*((_name_pattern(ours), hf) for hf, ours in names), *_AXTORCH_TO_HF])
    if hf is None:
        raise KeyError(f"no HF Llama-layout parameter corresponds to axtorch parameter {name!r}")
    return hf


def hf_to_axtorch_state_dict(
    state: Mapping[str, torch.Tensor] | Iterable[NamedTensor], tie_embeddings: bool
) -> dict[str, torch.Tensor]:
    """Rename canonical HF tensors; drops RoPE caches and, when tied, the (redundant) ``lm_head.weight``."""
    items = state.items() if isinstance(state, Mapping) else state
    return dict(_renamed_from_hf(items, tie_embeddings))


def _renamed_from_hf(
    tensors: Iterable[NamedTensor], tie_embeddings: bool, names: NameTemplates = ()
) -> Iterator[NamedTensor]:
    for name, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq") or (tie_embeddings and name == "lm_head.weight"):
            continue
        yield hf_to_axtorch_name(name, names), tensor


def axtorch_to_hf_state_dict(state: Mapping[str, torch.Tensor], names: NameTemplates = ()) -> dict[str, torch.Tensor]:
    """Rename axtorch tensors to the canonical HF names (stacked experts stay stacked)."""
    return {axtorch_to_hf_name(name, names): tensor for name, tensor in state.items()}


def rope_from_hf(get: Getter) -> RotaryEmbeddingConfig:
    """The RoPE config for HF's ``rope_scaling`` (older files) or ``rope_parameters`` (transformers 5)."""
    source = "rope_scaling" if get("rope_scaling") else "rope_parameters"
    settings = dict(get(source) or {})
    rope_type = settings.get("rope_type") or settings.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"HF config {source}.rope_type={rope_type!r} is not supported; supported: {sorted(ROPE_TYPES)}"
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
    config_class, required = ROPE_TYPES[rope_type]
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


def rope_to_hf(position: RotaryEmbeddingConfig) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` in the form both transformers 4 and 5 read."""
    rope_type = next(name for name, (cls, _) in ROPE_TYPES.items() if cls is type(position))
    scaling = {
        field.name: getattr(position, field.name) for field in dataclasses.fields(position) if field.name != "theta"
    }
    scaling = {key: value for key, value in scaling.items() if value is not None}
    return {"rope_theta": position.theta, "rope_scaling": {"rope_type": rope_type, **scaling} if scaling else None}


def mask_from_layer_types(window: Optional[int], layer_types: Optional[list[str]]) -> MaskConfig:
    """Causal, or a sliding window when the HF model uses the same ``window`` in every layer."""
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


def sliding_window(config: CausalLMConfig) -> Optional[int]:
    mask = config.decoder.layer.attention.mask
    return mask.window if type(mask) is SlidingWindowMaskConfig else None


def dense_feed_forward(hidden_dim: int, activation: Activation, bias: bool) -> GatedFeedForwardConfig:
    return GatedFeedForwardConfig(
        hidden_dim=hidden_dim,
        activation=activation,
        projection=LinearConfig(bias=bias),
        output_projection=LinearConfig(bias=bias),
    )


#: ``biases(get)``: a family's (q/k/v, output, MLP) projection biases from its HF config.
Biases = Callable[[Getter], tuple[bool, bool, bool]]


def llama_biases(get: Getter) -> tuple[bool, bool, bool]:
    """``attention_bias`` covers all four attention projections, ``mlp_bias`` the three MLP ones."""
    attention = bool(get("attention_bias", False))
    return attention, attention, bool(get("mlp_bias", False))


def qkv_biases(get: Getter) -> tuple[bool, bool, bool]:
    """Biases on the query, key and value projections only, whatever the config says (Qwen2)."""
    return True, False, False


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaLayout:
    """A family of the Llama layout: what its HF config says, and what only it requires.

    ``mask`` and ``biases`` read what the family's HF config says about them; ``fields(config,
    require)`` checks what only this family requires and returns its own ``config.json`` fields;
    ``qk_norm``: the family normalises each head's queries and keys (and every model it writes
    must); ``default_head_dim``, ``default_activation``, ``default_tie``: the head size (else
    dim / heads), ``hidden_act`` and ``tie_word_embeddings`` when the config gives none;
    ``scaled_embedding``: token vectors are scaled by sqrt(dim); ``norm_offset``: the family's
    RMSNorms multiply by ``offset + weight`` (Gemma's ``1 + weight``), so the offset is added to
    its norm weights on import and taken off on export; ``experts``: every layer's MLP is a
    mixture of experts in this format; ``names``: the family's own parameter names (see
    ``NameTemplates``). ``family()`` is the ``Family`` the registry holds.
    """

    model_type: str
    architecture: str
    mask: Callable[[Getter], MaskConfig]
    biases: Biases
    fields: Callable[[CausalLMConfig, Callable[[bool, str], None]], dict[str, Any]]
    qk_norm: bool = False
    default_head_dim: Optional[int] = None
    default_activation: str = "silu"
    default_tie: bool = False
    scaled_embedding: bool = False
    norm_offset: float = 0.0
    experts: Optional[ExpertFormat] = None
    names: NameTemplates = ()
    gguf: Optional[GGUFLayout] = None

    def family(self) -> Family:
        return Family(
            model_type=self.model_type,
            architecture=self.architecture,
            config_from_hf=self.config_from_hf,
            config_to_hf=self.config_to_hf,
            tensors_from_hf=self.tensors_from_hf,
            tensors_to_hf=self.tensors_to_hf,
            gguf=self.gguf,
        )

    def config_from_hf(self, get: Getter) -> CausalLMConfig:
        if get("quantization_config") is not None:
            raise ValueError("HF config quantization_config is set: quantized checkpoints are not supported")
        hidden_act = get("hidden_act", None) or get("hidden_activation", None) or self.default_activation
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"HF config hidden_act={hidden_act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        activation = ACTIVATIONS[hidden_act]
        qkv_bias, output_bias, ffn_bias = self.biases(get)
        norm_eps = get("rms_norm_eps", 1e-6)
        qk = RMSNormConfig(eps=norm_eps) if self.qk_norm else None
        feed_forward: FeedForwardConfig = (
            self.experts.read(get, activation)
            if self.experts
            else dense_feed_forward(get("intermediate_size"), activation, ffn_bias)
        )
        return CausalLMConfig(
            vocab_size=get("vocab_size"),
            dim=get("hidden_size"),
            max_seq_len=get("max_position_embeddings", 2048),
            tie_embeddings=bool(get("tie_word_embeddings", self.default_tie)),
            embedding=EmbeddingConfig(scale_by_sqrt_dim=self.scaled_embedding),
            decoder=DecoderConfig(
                num_layers=get("num_hidden_layers"),
                layer=TransformerLayerConfig(
                    attention=AttentionConfig(
                        num_heads=get("num_attention_heads"),
                        num_kv_heads=get("num_key_value_heads") or get("num_attention_heads"),
                        head_dim=get("head_dim", self.default_head_dim),
                        dropout=float(get("attention_dropout", 0.0)),
                        qkv_projection=LinearConfig(bias=qkv_bias),
                        output_projection=LinearConfig(bias=output_bias),
                        query_norm=qk,
                        key_norm=qk,
                        position=rope_from_hf(get),
                        mask=self.mask(get),
                    ),
                    feed_forward=feed_forward,
                    norm=RMSNormConfig(eps=norm_eps),
                    residual=PreNormResidualConfig(),
                ),
            ),
        )

    def config_to_hf(self, config: CausalLMConfig) -> dict[str, Any]:
        """Only exact config types are accepted: a subclass may compute something else."""
        require = requirement(self.architecture)
        layer = config.decoder.layer
        attention, norm = layer.attention, layer.norm
        self._require_attention(config, require)
        feed_forward_fields = self._feed_forward_fields(config, require)
        self._require_model(config, require)
        own_fields = self.fields(config, require)
        position = attention.position
        assert isinstance(position, RotaryEmbeddingConfig)  # _require_attention checked it
        hidden_act = {ours: hf for hf, ours in ACTIVATIONS.items()}[layer.feed_forward.activation]
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": config.vocab_size,
            "hidden_size": config.dim,
            "intermediate_size": layer.feed_forward.hidden_dim,
            "num_hidden_layers": config.decoder.num_layers,
            "num_attention_heads": attention.num_heads,
            "num_key_value_heads": attention.resolved_kv_heads(),
            "head_dim": attention.resolved_head_dim(config.dim),
            "hidden_act": hidden_act,
            "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": norm.eps,
            **rope_to_hf(position),
            "attention_dropout": attention.dropout,
            **own_fields,
            **feed_forward_fields,
            "tie_word_embeddings": config.tie_embeddings,
        }

    def _require_attention(self, config: CausalLMConfig, require: Callable[[bool, str], None]) -> None:
        """The layer's norms, position encoding, mask, QK-norm and kernel are the family's."""
        layer = config.decoder.layer
        attention, norm = layer.attention, layer.norm
        final_norm = config.decoder.final_norm or norm
        require(type(norm) is RMSNormConfig, f"layer norm {type(norm).__name__} (it uses RMSNorm)")
        require(
            type(final_norm) is RMSNormConfig and final_norm.eps == norm.eps,
            f"final norm {final_norm} differs from the layer norm {norm} (it has one rms_norm_eps)",
        )
        require(
            any(type(attention.position) is cls for cls, _ in ROPE_TYPES.values()),
            f"position encoding {type(attention.position).__name__} (it uses RoPE: {sorted(ROPE_TYPES)})",
        )
        require(
            type(attention.mask) in (CausalMaskConfig, SlidingWindowMaskConfig),
            f"attention mask {type(attention.mask).__name__}",
        )
        if self.qk_norm:
            require(
                all(type(n) is RMSNormConfig and n.eps == norm.eps for n in (attention.query_norm, attention.key_norm)),
                f"query/key norms {attention.query_norm} and {attention.key_norm} (it has RMSNorms on both, "
                f"with the layer norm's eps {norm.eps})",
            )
        else:
            require(attention.query_norm is None and attention.key_norm is None, "query/key norms")
        require(
            attention.softmax_scale is None and type(attention.kernel) in (type(None), SdpaKernelConfig),
            f"attention softmax_scale={attention.softmax_scale}, kernel={type(attention.kernel).__name__} "
            "(it scales by 1/sqrt(head_dim) and does not cap)",
        )

    def _feed_forward_fields(self, config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
        """The experts' ``config.json`` fields, or none for the family's gated MLP."""
        if self.experts:
            return self.experts.write(config, require)
        feed_forward = config.decoder.layer.feed_forward
        require(
            type(feed_forward) is GatedFeedForwardConfig,
            f"feed-forward {type(feed_forward).__name__} (it uses a gated MLP)",
        )
        assert isinstance(feed_forward, GatedFeedForwardConfig)
        require(
            feed_forward.projection.bias == feed_forward.output_projection.bias,
            "bias on some feed-forward projections only (mlp_bias covers all three)",
        )
        return {}

    def _require_model(self, config: CausalLMConfig, require: Callable[[bool, str], None]) -> None:
        """Around the layers: one layer config throughout, the head, the embeddings and the residuals."""
        layer = config.decoder.layer
        require(config.tie_embeddings or not config.lm_head.bias, "a bias on the output head")
        require(config.logit_softcap is None, f"logits soft-capped by {config.logit_softcap}")
        require(
            all(each == layer for each in config.decoder.layer_configs()),
            f"layers that differ (decoder.pattern={config.decoder.pattern})",
        )
        require(config.position_embedding is None, "absolute position embeddings (it has only RoPE)")
        require(
            config.embedding.multiplier == 1.0 and config.embedding.scale_by_sqrt_dim == self.scaled_embedding,
            f"token embeddings scaled by multiplier={config.embedding.multiplier}, "
            f"scale_by_sqrt_dim={config.embedding.scale_by_sqrt_dim} (it scales by "
            f"{'sqrt(dim)' if self.scaled_embedding else 'nothing'})",
        )
        require(config.embedding_dropout == 0.0, f"embedding_dropout={config.embedding_dropout} (it has none)")
        require(
            layer.residual is None or (type(layer.residual) is PreNormResidualConfig and layer.residual.dropout == 0.0),
            f"norm placement {layer.residual} (it is pre-norm, without residual dropout)",
        )

    def tensors_from_hf(self, config: CausalLMConfig, tensors: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
        if self.experts:
            tensors = stack_experts(tensors, config.decoder.layer.feed_forward, self.experts)
        renamed = _renamed_from_hf(tensors, config.tie_embeddings, self.names)
        return ((name, offset_norm(name, tensor, self.norm_offset)) for name, tensor in renamed)

    def tensors_to_hf(self, config: CausalLMConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        offset = {name: offset_norm(name, t, -self.norm_offset) for name, t in state.items()}
        renamed = axtorch_to_hf_state_dict(offset, self.names)
        return dict(unstack_experts(renamed.items(), self.experts)) if self.experts else renamed


def offset_norm(name: str, tensor: torch.Tensor, offset: float) -> torch.Tensor:
    """``tensor + offset`` for an axtorch norm weight (``*_norm.weight``), any other tensor as it is."""
    return tensor + offset if offset and name.endswith("norm.weight") else tensor


def attention_bias_field(config: CausalLMConfig, require: Callable[[bool, str], None]) -> bool:
    """Llama's ``attention_bias``, which puts biases on all four attention projections or none."""
    qkv, output = attention_biases(config)
    require(
        qkv == output,
        "bias on the q/k/v projections but not the output one, or the reverse (attention_bias covers all four)",
    )
    return qkv


def attention_biases(config: CausalLMConfig) -> tuple[bool, bool]:
    """(q/k/v, output) projection biases."""
    attention = config.decoder.layer.attention
    return attention.qkv_projection.bias, attention.output_projection.bias


def mlp_bias(config: CausalLMConfig) -> bool:
    feed_forward = config.decoder.layer.feed_forward
    return isinstance(feed_forward, GatedFeedForwardConfig) and feed_forward.projection.bias
