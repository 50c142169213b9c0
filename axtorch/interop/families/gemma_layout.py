"""Gemma 2 and Gemma 3: Gemma's Llama layout with layers that differ, and the factory for both.

Both alternate sliding-window ("local") and global layers (``layer_types``; Gemma 2 every other
layer, Gemma 3 five local to one global), normalise each sublayer's output as well as its input
(sandwich norms: ``post_attention_layernorm`` is the attention's post-norm, and the feed-forward
has a ``pre_``/``post_feedforward_layernorm`` pair), and scale the scores by
``query_pre_attn_scalar ** -0.5``. Gemma 2 soft-caps attention scores and final logits; Gemma 3
normalises queries and keys and gives local layers their own RoPE base (10,000 against the
global layers' 1,000,000).

An axtorch model of either is a decoder whose ``layer`` is the global layer and whose
``local`` variant changes its mask (and, for Gemma 3, its RoPE) only. The family is built
around a Llama-layout family (``LlamaLayout``), which reads and writes everything the
layers share; this file adds what differs between layers and what the shared layout refuses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Optional

from axtorch.interop.families.family import Family, Getter, GGUFLayout, requirement
from axtorch.interop.families.layer_types import FULL, SLIDING, check_layer_types, layer_types_of, local_and_global
from axtorch.interop.families.llama_layout import (
    LlamaLayout,
    attention_bias_field,
    llama_biases,
    mlp_bias,
    rope_from_hf,
)
from axtorch.layers.attention_kernel import SdpaKernelConfig, SoftcappedKernelConfig
from axtorch.layers.attention_mask import CausalMaskConfig, SlidingWindowMaskConfig
from axtorch.layers.relative_position import PositionConfig, RotaryEmbeddingConfig
from axtorch.layers.residual import PreNormResidualConfig, SandwichNormResidualConfig
from axtorch.layers.softcap import SoftCapConfig
from axtorch.layers.transformer import TransformerLayerConfig
from axtorch.models.causal_lm import CausalLMConfig

#: The sandwich norms' HF names: the attention's post-norm takes the name Llama gives the
#: feed-forward's pre-norm.
SANDWICH_NAMES = (
    ("model.layers.{i}.post_attention_layernorm", "decoder.layers.{i}.attention_residual.post_norm"),
    ("model.layers.{i}.pre_feedforward_layernorm", "decoder.layers.{i}.feed_forward_norm"),
    ("model.layers.{i}.post_feedforward_layernorm", "decoder.layers.{i}.feed_forward_residual.post_norm"),
)
#: llama.cpp's names for them (``blk.{i}.<name>``), against HF's module names.
SANDWICH_GGUF_NAMES = (
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
)


def layer_types(get: Getter, every: int) -> list[str]:
    """HF's ``layer_types``, or (older configs) every ``sliding_window_pattern``-th layer global."""
    types = get("layer_types")
    if types is not None:
        return list(types)
    period = get("sliding_window_pattern", every)
    return [FULL if (i + 1) % period == 0 else SLIDING for i in range(get("num_hidden_layers"))]


def _rope_getter(get: Getter, scope: str) -> Getter:
    """``get`` with transformers 5's per-layer-type ``rope_parameters[scope]`` as the only RoPE settings."""
    parameters = get("rope_parameters") or {}
    if scope not in parameters:
        return get
    hidden = {"rope_scaling": None, "rope_theta": None, "rope_parameters": parameters[scope]}
    return lambda key, default=None: hidden[key] if key in hidden else get(key, default)


def _local_position(get: Getter, local_rope: bool, global_position: PositionConfig) -> PositionConfig:
    if not local_rope:
        return global_position
    parameters = get("rope_parameters") or {}
    if SLIDING in parameters:
        return rope_from_hf(_rope_getter(get, SLIDING))
    return RotaryEmbeddingConfig(theta=float(get("rope_local_base_freq", 10000.0)))


#: ``LlamaLayout`` arguments of every Gemma generation.
GEMMA_LAYOUT: dict[str, Any] = {
    "biases": llama_biases,
    "default_head_dim": 256,
    "default_activation": "gelu_pytorch_tanh",
    "default_tie": True,
    "scaled_embedding": True,
    "norm_offset": 1.0,
}


def refuse_bidirectional(get: Getter) -> None:
    """Gemma configs may ask for bidirectional attention (embedding models); axtorch decoders are causal."""
    if get("use_bidirectional_attention", False):
        raise ValueError("HF config use_bidirectional_attention=True is not supported: axtorch decoders are causal")


def gemma_layout_family(
    model_type: str,
    architecture: str,
    *,
    every: int,
    qk_norm: bool,
    local_rope: bool,
    gguf: Optional[GGUFLayout] = None,
) -> Family:
    """A Gemma 2-like family: every ``every``-th layer global by default (older configs name no
    ``layer_types``); ``qk_norm``: queries and keys normalised (Gemma 3); ``local_rope``: local
    layers have a RoPE of their own (Gemma 3's ``rope_local_base_freq``)."""
    require = requirement(architecture)

    def fields(config: CausalLMConfig, require: Callable[[bool, str], None]) -> dict[str, Any]:
        require(not mlp_bias(config), "feed-forward biases")
        return {"attention_bias": attention_bias_field(config, require)}

    shared = LlamaLayout(
        model_type=model_type,
        architecture=architecture,
        mask=lambda get: CausalMaskConfig(),
        fields=fields,
        qk_norm=qk_norm,
        names=SANDWICH_NAMES,
        gguf=gguf,
        **GEMMA_LAYOUT,
    )

    def config_from_hf(get: Getter) -> CausalLMConfig:
        refuse_bidirectional(get)
        config = shared.config_from_hf(_rope_getter(get, FULL))
        types = check_layer_types(layer_types(get, every), config.decoder.num_layers)
        layer = config.decoder.layer
        attention = dataclasses.replace(
            layer.attention,
            softmax_scale=float(get("query_pre_attn_scalar", 256)) ** -0.5,
            kernel=_kernel(get("attn_logit_softcapping")),
        )
        variants: dict[str, Any] = {}
        pattern: list[str] = []
        if SLIDING in types:
            local_attention: dict[str, Any] = {"mask": SlidingWindowMaskConfig(window=get("sliding_window", 4096))}
            local_position = _local_position(get, local_rope, attention.position)
            if local_position != attention.position:
                local_attention["position"] = _override(attention.position, local_position)
            variants, pattern = local_and_global(types, {"attention": local_attention})
        final_cap = get("final_logit_softcapping")
        decoder = dataclasses.replace(
            config.decoder,
            layer=dataclasses.replace(layer, attention=attention, residual=SandwichNormResidualConfig()),
            variants=variants,
            pattern=pattern,
        )
        return dataclasses.replace(
            config, decoder=decoder, logit_softcap=SoftCapConfig(cap=float(final_cap)) if final_cap else None
        )

    def config_to_hf(config: CausalLMConfig) -> dict[str, Any]:
        layers = config.decoder.layer_configs()
        types, window = layer_types_of(layers, require)
        local = [layer for layer, kind in zip(layers, types) if kind == SLIDING]
        reference = next((layer for layer, kind in zip(layers, types) if kind == FULL), layers[0])
        global_position = reference.attention.position
        local_position = local[0].attention.position if local else global_position
        if local_rope:
            require(
                type(local_position) is RotaryEmbeddingConfig,
                f"local layers' position encoding {local_position} (it gives them plain RoPE)",
            )
        else:
            require(local_position == global_position, "local layers with a RoPE of their own")
        positions = {FULL: global_position, SLIDING: local_position}
        shared_part = _with(reference, global_position)
        require(
            all(
                layer.attention.position == positions[kind] and _with(layer, global_position) == shared_part
                for layer, kind in zip(layers, types)
            ),
            "layers that differ in more than their mask" + (" and the local layers' RoPE" if local_rope else ""),
        )
        residual = reference.residual
        require(
            type(residual) is SandwichNormResidualConfig and residual.dropout == 0.0,
            f"norm placement {residual} (it normalises each sublayer's input and output, without dropout)",
        )
        attention = reference.attention
        kernel = attention.kernel
        require(
            type(kernel) in (type(None), SdpaKernelConfig, SoftcappedKernelConfig),
            f"attention kernel {type(kernel).__name__} (it may soft-cap scores, nothing else)",
        )
        head_dim = attention.resolved_head_dim(config.dim)
        scalar = head_dim if attention.softmax_scale is None else attention.softmax_scale**-2
        uniform = dataclasses.replace(
            reference,
            residual=PreNormResidualConfig(),
            attention=dataclasses.replace(attention, mask=CausalMaskConfig(), kernel=None, softmax_scale=None),
        )
        stand_in = dataclasses.replace(
            config,
            decoder=dataclasses.replace(config.decoder, layer=uniform, variants={}, pattern=[]),
            logit_softcap=None,
        )
        hf = shared.config_to_hf(stand_in)
        cap = config.logit_softcap
        hf.update(
            hidden_activation=hf["hidden_act"],
            query_pre_attn_scalar=round(scalar) if math.isclose(scalar, round(scalar)) else scalar,
            sliding_window=window,
            layer_types=types,
            attn_logit_softcapping=kernel.cap if isinstance(kernel, SoftcappedKernelConfig) else None,
            final_logit_softcapping=None if cap is None else cap.cap,
        )
        if local_rope:
            assert isinstance(local_position, RotaryEmbeddingConfig)  # required above
            hf["rope_local_base_freq"] = local_position.theta
        return hf

    return dataclasses.replace(shared.family(), config_from_hf=config_from_hf, config_to_hf=config_to_hf)


def _override(base: PositionConfig, position: PositionConfig) -> PositionConfig | dict[str, float]:
    """What a variant states of ``position`` over ``base``: the RoPE base alone if only it differs."""
    if not (isinstance(base, RotaryEmbeddingConfig) and isinstance(position, RotaryEmbeddingConfig)):
        return position
    return {"theta": position.theta} if position == dataclasses.replace(base, theta=position.theta) else position


def _kernel(cap: Optional[float]) -> Optional[SoftcappedKernelConfig]:
    return SoftcappedKernelConfig(cap=float(cap)) if cap else None


def _with(layer: TransformerLayerConfig, position: PositionConfig) -> TransformerLayerConfig:
    """``layer`` with a causal mask and ``position``: the part every layer of the family shares."""
    attention = dataclasses.replace(layer.attention, mask=CausalMaskConfig(), position=position)
    return dataclasses.replace(layer, attention=attention)


def llama_cpp_layout(architecture: str, *, every: int, layers_27b: int, local_base: Optional[float]) -> GGUFLayout:
    """How llama.cpp stores a Gemma 2-like family as ``architecture``.

    A file keeps only the window; llama.cpp supplies the rest itself: every ``every``-th layer
    global, local layers at RoPE base ``local_base`` (None: the global base), and scores scaled
    by ``1/sqrt(head_dim)``, except in the 27B model (``layers_27b`` layers), which scales by
    ``1/sqrt(dim / heads)``. The reader supplies the same; the writer refuses models that differ.
    Gemma 2's soft caps are in the file (``attn_logit_softcapping``, ``final_logit_softcapping``).
    """
    softcaps = local_base is None

    def query_pre_attn_scalar(hf: dict[str, Any]) -> float:
        wide = hf["num_hidden_layers"] == layers_27b
        return hf["hidden_size"] // hf["num_attention_heads"] if wide else hf["head_dim"]

    def config_fields(key: Getter) -> dict[str, Any]:
        fields = {
            "sliding_window": key("attention.sliding_window"),
            "sliding_window_pattern": every,
            "attn_logit_softcapping": key("attn_logit_softcapping", None) if softcaps else None,
            "final_logit_softcapping": key("final_logit_softcapping", None) if softcaps else None,
        }
        if local_base is not None:
            fields["rope_local_base_freq"] = local_base
        shape = {
            "num_hidden_layers": key("block_count"),
            "hidden_size": key("embedding_length"),
            "num_attention_heads": key("attention.head_count"),
            "head_dim": key("attention.key_length"),
        }
        return {**fields, "query_pre_attn_scalar": query_pre_attn_scalar(shape)}

    def metadata(hf: Mapping[str, Any]) -> dict[str, Any]:
        names = ("attn_logit_softcapping", "final_logit_softcapping") if softcaps else ()
        caps = {name: hf[name] for name in names if hf.get(name) is not None}
        return {"attention.sliding_window": hf["sliding_window"], **caps}

    def refuses(hf: Mapping[str, Any]) -> Optional[str]:
        expected_types = [FULL if (i + 1) % every == 0 else SLIDING for i in range(hf["num_hidden_layers"])]
        if hf["layer_types"] != expected_types or hf["sliding_window"] is None:
            return f"layer_types={hf['layer_types']} (it makes every {every}th layer global, the others sliding)"
        if hf["query_pre_attn_scalar"] != query_pre_attn_scalar(dict(hf)):
            return f"query_pre_attn_scalar={hf['query_pre_attn_scalar']} (it derives the scale from the shape)"
        if local_base is not None and hf.get("rope_local_base_freq") != local_base:
            return f"rope_local_base_freq={hf.get('rope_local_base_freq')} (local layers use {local_base})"
        if not softcaps and (hf.get("attn_logit_softcapping") or hf.get("final_logit_softcapping")):
            return "soft-capped scores or logits"
        return None

    return GGUFLayout(
        architecture,
        norm_offset=1.0,
        config_fields=config_fields,
        metadata=metadata,
        refuses=refuses,
        layer_names=SANDWICH_GGUF_NAMES,
        hf_names=SANDWICH_NAMES,
    )
