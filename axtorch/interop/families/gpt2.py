"""Hugging Face GPT-2 <-> axtorch: config mapping and weight conversion.

GPT-2 is axtorch's pre-norm decoder with a learned absolute position table
(``position_embedding``), no position encoding inside attention, biased LayerNorms, a two-matrix
GELU (tanh) MLP, biases on every projection, and dropout on the embeddings (``embd_pdrop``), the
attention weights (``attn_pdrop``) and the residual branches (``resid_pdrop``). Its HF weights
need more than renaming: each projection in a block is a ``Conv1D``, whose ``weight`` is
[in, out] (the transpose of ours), and the queries, keys and values come from one fused
``c_attn`` projection, split on import and concatenated on export. A config field that axtorch
cannot honour raises ``ValueError`` naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from axtorch.interop.families.family import Family, Getter, NamedTensor, requirement
from axtorch.layers.attention import AttentionConfig
from axtorch.layers.attention_mask import CausalMaskConfig
from axtorch.layers.feed_forward import Activation, MLPFeedForwardConfig
from axtorch.layers.linear import LinearConfig
from axtorch.layers.norm import LayerNormConfig
from axtorch.layers.position_embedding import LearnedPositionEmbeddingConfig
from axtorch.layers.relative_position import NoPositionConfig
from axtorch.layers.residual import PreNormResidualConfig
from axtorch.layers.transformer import DecoderConfig, TransformerLayerConfig
from axtorch.models.causal_lm import CausalLMConfig

#: ``GPT2Config``'s defaults, for the keys a ``config.json`` leaves out.
_HF_DEFAULTS = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "activation_function": "gelu_new",
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
}

#: HF flags that change the attention computation -> the one value axtorch computes (also GPT2Config's default).
_REQUIRED_FLAGS = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}

#: HF ``activation_function`` -> axtorch activation, for the functions that compute the same thing.
_ACTIVATIONS = {
    "gelu_new": Activation.gelu_tanh,
    "gelu_pytorch_tanh": Activation.gelu_tanh,
    "gelu": Activation.gelu,
    "relu": Activation.relu,
    "silu": Activation.silu,
}
#: axtorch activation -> the name written back: the first listed above (GPT-2's ``gelu_new``).
_HF_ACTIVATIONS = {ours: hf for hf, ours in reversed(_ACTIVATIONS.items())}

#: HF module -> axtorch module, outside the blocks.
_TOP_LEVEL = {"wte": "embedding", "wpe": "position_embedding", "ln_f": "decoder.final_norm", "lm_head": "lm_head"}
#: HF module in block ``h.{i}`` -> axtorch module in ``decoder.layers.{i}``, except the fused q/k/v.
_IN_LAYER = {
    "ln_1": "attention_norm",
    "attn.c_proj": "attention.o_proj",
    "ln_2": "feed_forward_norm",
    "mlp.c_fc": "feed_forward.up_proj",
    "mlp.c_proj": "feed_forward.down_proj",
}
_FUSED_QKV = "attn.c_attn"
_QKV = ("attention.q_proj", "attention.k_proj", "attention.v_proj")
#: Modules whose ``weight`` is stored [in, out].
_CONV1D = (_FUSED_QKV, "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
#: Causal-mask buffers that older checkpoints (e.g. openai-community/gpt2's) store beside the weights.
_MASK_BUFFERS = ("attn.bias", "attn.masked_bias")

_HF_BLOCK = re.compile(r"h\.(?P<i>\d+)\.(?P<rest>.+)")
_AXTORCH_LAYER = re.compile(r"decoder\.layers\.(?P<i>\d+)\.(?P<rest>.+)")


def _config_from_hf(get: Getter) -> CausalLMConfig:
    """An axtorch config equal in function to a HF GPT-2 config."""
    hf = {key: get(key, default) for key, default in _HF_DEFAULTS.items()}
    if get("quantization_config") is not None:
        raise ValueError("HF config quantization_config is set: quantized checkpoints are not supported")
    unsupported = {flag: get(flag, value) for flag, value in _REQUIRED_FLAGS.items() if bool(get(flag, value)) != value}
    if unsupported:
        raise ValueError(
            "HF config "
            + ", ".join(f"{flag}={value!r}" for flag, value in unsupported.items())
            + " is not supported; supported: "
            + ", ".join(f"{flag}={_REQUIRED_FLAGS[flag]}" for flag in unsupported)
        )
    activation = hf["activation_function"]
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"HF config activation_function={activation!r} is not supported; supported: {sorted(_ACTIVATIONS)}"
        )
    dim = hf["n_embd"]
    return CausalLMConfig(
        vocab_size=hf["vocab_size"],
        dim=dim,
        max_seq_len=hf["n_positions"],
        position_embedding=LearnedPositionEmbeddingConfig(),
        embedding_dropout=float(hf["embd_pdrop"]),
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        decoder=DecoderConfig(
            num_layers=hf["n_layer"],
            layer=TransformerLayerConfig(
                attention=AttentionConfig(
                    num_heads=hf["n_head"],
                    dropout=float(hf["attn_pdrop"]),
                    qkv_projection=LinearConfig(bias=True),
                    output_projection=LinearConfig(bias=True),
                    position=NoPositionConfig(),
                    mask=CausalMaskConfig(),
                ),
                feed_forward=MLPFeedForwardConfig(
                    hidden_dim=hf["n_inner"] or 4 * dim,
                    activation=_ACTIVATIONS[activation],
                    projection=LinearConfig(bias=True),
                    output_projection=LinearConfig(bias=True),
                ),
                norm=LayerNormConfig(eps=hf["layer_norm_epsilon"], bias=True),
                residual=PreNormResidualConfig(dropout=float(hf["resid_pdrop"])),
            ),
        ),
    )


_require = requirement("GPT2LMHeadModel")


def _config_to_hf(config: CausalLMConfig) -> dict[str, Any]:
    """A ``config.json`` dict for ``config`` as a HF ``GPT2LMHeadModel``.

    ``CannotExpress`` naming the first feature GPT-2 lacks. Only exact config types are accepted: a
    subclass may compute something else.
    """
    layer = config.decoder.layer
    attention, feed_forward, norm = layer.attention, layer.feed_forward, layer.norm
    final_norm = config.decoder.final_norm or norm
    residual = layer.residual or PreNormResidualConfig()
    _require(
        type(config.position_embedding) is LearnedPositionEmbeddingConfig,
        f"position embedding {type(config.position_embedding).__name__} (GPT-2 learns a table)",
    )
    _require(
        type(attention.position) is NoPositionConfig,
        f"position encoding {type(attention.position).__name__} in attention (GPT-2 has none there)",
    )
    _require(type(attention.mask) is CausalMaskConfig, f"attention mask {type(attention.mask).__name__}")
    _require(attention.query_norm is None and attention.key_norm is None, "query/key norms")
    _require(
        attention.resolved_kv_heads() == attention.num_heads
        and attention.resolved_head_dim(config.dim) * attention.num_heads == config.dim,
        f"{attention.resolved_kv_heads()} key/value heads of size {attention.resolved_head_dim(config.dim)} "
        f"(GPT-2 has {attention.num_heads} heads of size dim / num_heads)",
    )
    _require(
        attention.qkv_projection.bias and attention.output_projection.bias,
        "attention projections without biases (GPT-2 has them on all)",
    )
    _require(
        type(feed_forward) is MLPFeedForwardConfig,
        f"feed-forward {type(feed_forward).__name__} (GPT-2 has a two-matrix MLP)",
    )
    _require(
        feed_forward.projection.bias and feed_forward.output_projection.bias,
        "feed-forward projections without biases (GPT-2 has them on both)",
    )
    _require(
        all(type(n) is LayerNormConfig and n.bias and n.eps == norm.eps for n in (norm, final_norm)),
        f"norms {norm} and {final_norm} (GPT-2 has biased LayerNorms with one layer_norm_epsilon)",
    )
    _require(type(residual) is PreNormResidualConfig, f"norm placement {type(residual).__name__} (GPT-2 is pre-norm)")
    _require(
        config.embedding.multiplier == 1.0 and not config.embedding.scale_by_sqrt_dim,
        "scaled token embeddings (multiplier or scale_by_sqrt_dim)",
    )
    _require(config.tie_embeddings or not config.lm_head.bias, "a bias on the output head")
    _require(config.logit_softcap is None, f"logits soft-capped by {config.logit_softcap}")
    _require(
        all(layer == config.decoder.layer for layer in config.decoder.layer_configs()),
        f"layers that differ (decoder.pattern={config.decoder.pattern})",
    )
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.max_seq_len,
        "n_embd": config.dim,
        "n_layer": config.decoder.num_layers,
        "n_head": attention.num_heads,
        "n_inner": feed_forward.hidden_dim,
        "activation_function": _HF_ACTIVATIONS[feed_forward.activation],
        "layer_norm_epsilon": norm.eps,
        "attn_pdrop": attention.dropout,
        "embd_pdrop": config.embedding_dropout,
        "resid_pdrop": residual.dropout,
        **_REQUIRED_FLAGS,
        "tie_word_embeddings": config.tie_embeddings,
    }


def _transposed_if_conv1d(hf_module: str, suffix: str, tensor: torch.Tensor) -> torch.Tensor:
    """A ``Conv1D`` weight [in, out] as ours [out, in], or the reverse (a view); other tensors as they are."""
    return tensor.t() if hf_module in _CONV1D and suffix == "weight" else tensor


def _tensors_from_hf(config: CausalLMConfig, tensors: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
    """HF GPT-2 tensors under axtorch's names, with q/k/v split out of ``c_attn``.

    Names may carry the ``transformer.`` prefix (``save_pretrained``) or not (the original
    checkpoints); mask buffers and, when tied, the redundant ``lm_head.weight`` are dropped.
    """
    for name, tensor in tensors:
        local = name.removeprefix("transformer.")
        block = _HF_BLOCK.fullmatch(local)
        if block is None:
            module, _, suffix = local.rpartition(".")
            if module == "lm_head" and config.tie_embeddings:
                continue
            target = _TOP_LEVEL.get(module)
        else:
            if block["rest"] in _MASK_BUFFERS:
                continue
            module, _, suffix = block["rest"].rpartition(".")
            layer = f"decoder.layers.{block['i']}."
            if module == _FUSED_QKV:
                # Copies, so that each of q, k and v owns its storage as a parameter should.
                parts = _transposed_if_conv1d(module, suffix, tensor).chunk(3)
                for target, part in zip(_QKV, parts):
                    yield f"{layer}{target}.{suffix}", part.clone(memory_format=torch.contiguous_format)
                continue
            target = layer + _IN_LAYER[module] if module in _IN_LAYER else None
        if target is None or suffix not in ("weight", "bias"):
            raise KeyError(f"no axtorch parameter corresponds to HF GPT-2 tensor {name!r}")
        yield f"{target}.{suffix}", _transposed_if_conv1d(module, suffix, tensor).contiguous()


def _tensors_to_hf(config: CausalLMConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """axtorch tensors under HF GPT-2's names as ``save_pretrained`` writes them, q/k/v fused into ``c_attn``."""
    top_level = {ours: hf for hf, ours in _TOP_LEVEL.items()}
    in_layer = {ours: hf for hf, ours in _IN_LAYER.items()}
    converted = {}
    for name, tensor in state.items():
        layer = _AXTORCH_LAYER.fullmatch(name)
        if layer is None:
            module, _, suffix = name.rpartition(".")
            hf_module = top_level.get(module)
            if hf_module is None:
                raise KeyError(f"no HF GPT-2 tensor corresponds to axtorch parameter {name!r}")
            converted[f"{'' if hf_module == 'lm_head' else 'transformer.'}{hf_module}.{suffix}"] = tensor
            continue
        module, _, suffix = layer["rest"].rpartition(".")
        prefix = f"decoder.layers.{layer['i']}."
        if module in _QKV[1:]:
            continue  # written with q_proj, in c_attn
        if module == _QKV[0]:
            hf_module, tensor = _FUSED_QKV, torch.cat([state[f"{prefix}{part}.{suffix}"] for part in _QKV])
        elif module in in_layer:
            hf_module = in_layer[module]
        else:
            raise KeyError(f"no HF GPT-2 tensor corresponds to axtorch parameter {name!r}")
        converted[f"transformer.h.{layer['i']}.{hf_module}.{suffix}"] = _transposed_if_conv1d(hf_module, suffix, tensor)
    return converted


GPT2 = Family(
    model_type="gpt2",
    architecture="GPT2LMHeadModel",
    config_from_hf=_config_from_hf,
    config_to_hf=_config_to_hf,
    tensors_from_hf=_tensors_from_hf,
    tensors_to_hf=_tensors_to_hf,
)
