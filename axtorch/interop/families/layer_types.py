"""HF's ``layer_types`` (each layer's attention: a sliding window or the full context) <-> a
decoder whose layers differ only in their mask.

transformers 5 states which layers slide in a ``layer_types`` list of ``sliding_attention`` and
``full_attention``; older configs imply it (Qwen2 and Qwen3 slide from layer
``max_window_layers`` on when ``use_sliding_window`` is set, Qwen2-MoE on alternate layers
before it), and transformers derives the list from those fields when a config has none. An
axtorch model of such a stack is a decoder whose ``layer`` attends causally to everything and
whose ``local`` variant changes only the mask to the window, in a ``pattern`` of the shortest
period of the list (see ``DecoderConfig``). A list of one kind stays a uniform decoder, so those
models keep their configs and checkpoint names. ``with_layer_types`` wraps a Llama-layout family
so that it reads and writes the list; the family itself sees one uniform, causal layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Optional

from axtorch.interop.families.family import Family, Getter, requirement
from axtorch.layers.attention_mask import CausalMaskConfig, SlidingWindowMaskConfig
from axtorch.layers.transformer import DecoderConfig, TransformerLayerConfig
from axtorch.models.causal_lm import CausalLMConfig

SLIDING, FULL = "sliding_attention", "full_attention"
#: The decoder variant of the sliding-window layers, and of the full ones (``decoder.layer`` itself).
LOCAL, GLOBAL = "local", "global"
#: ``slides(i, max_window_layers)``: whether a family's layer ``i`` slides, by its rule for configs
#: without ``layer_types``, when ``use_sliding_window`` is set.
SlidingRule = Callable[[int, int], bool]
Require = Callable[[bool, str], None]


def shortest_period(items: list[str]) -> list[str]:
    """The shortest prefix that, repeated, gives ``items``: ``[a, a, b, a, a, b]`` -> ``[a, a, b]``."""
    for length in range(1, len(items) + 1):
        if all(item == items[i % length] for i, item in enumerate(items)):
            return items[:length]
    return items


def local_and_global(types: list[str], local: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A decoder's (``variants``, ``pattern``) for HF ``types`` whose sliding layers differ from the
    full ones by ``local`` (a partial layer tree) only."""
    pattern = [LOCAL if kind == SLIDING else GLOBAL for kind in shortest_period(types)]
    return {name: local if name == LOCAL else {} for name in set(pattern)}, pattern


def check_layer_types(types: list[str], num_layers: int) -> list[str]:
    """``types``, if it names full or sliding attention for each of ``num_layers`` layers; else ``ValueError``."""
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown or len(types) != num_layers:
        raise ValueError(
            f"HF config layer_types={types} is not supported: one of {[SLIDING, FULL]} for each of the "
            f"{num_layers} layers"
        )
    return types


def qwen_layer_types(get: Getter, slides: SlidingRule) -> tuple[list[str], Optional[int]]:
    """A Qwen config's ``layer_types`` and window (None when no layer slides), as transformers reads them.

    The window exists only when ``use_sliding_window`` is set; ``layer_types``, when given, says
    which layers use it, else ``slides(i, max_window_layers)`` does.
    """
    num_layers = get("num_hidden_layers")
    window = get("sliding_window", 4096) if get("use_sliding_window", False) else None
    given = get("layer_types")
    types = check_layer_types(
        list(given) if given else _by_rule(num_layers, window, get("max_window_layers", 28), slides), num_layers
    )
    if SLIDING in types and not window:
        raise ValueError(
            f"HF config layer_types={types} has sliding_attention layers but no window "
            f"(use_sliding_window={get('use_sliding_window', False)}, sliding_window={get('sliding_window')}): "
            "transformers cannot run it"
        )
    return types, window if SLIDING in types else None


def qwen_window_fields(types: list[str], window: Optional[int], slides: SlidingRule) -> dict[str, Any]:
    """The inverse of ``qwen_layer_types``: ``layer_types`` and the window, and for transformers
    versions that read no ``layer_types`` the ``max_window_layers`` that gives the same list under
    ``slides``, when one does."""
    fields: dict[str, Any] = {"use_sliding_window": window is not None, "sliding_window": window, "layer_types": types}
    for first in range(len(types), -1, -1):
        if types == _by_rule(len(types), window, first, slides):
            fields["max_window_layers"] = first
            break
    return fields


def _by_rule(num_layers: int, window: Optional[int], max_window_layers: int, slides: SlidingRule) -> list[str]:
    """The ``layer_types`` transformers derives for a Qwen config without them."""
    return [SLIDING if window is not None and slides(i, max_window_layers) else FULL for i in range(num_layers)]


def decoder_with_layer_types(decoder: DecoderConfig, types: list[str], window: Optional[int]) -> DecoderConfig:
    """``decoder`` (its ``layer`` causal) with HF ``types``' sliding layers attending within ``window``."""
    if SLIDING not in types:
        return decoder
    assert window is not None  # qwen_layer_types refuses sliding layers without one
    mask = SlidingWindowMaskConfig(window=window)
    if FULL not in types:
        attention = dataclasses.replace(decoder.layer.attention, mask=mask)
        return dataclasses.replace(decoder, layer=dataclasses.replace(decoder.layer, attention=attention))
    variants, pattern = local_and_global(types, {"attention": {"mask": mask}})
    return dataclasses.replace(decoder, variants=variants, pattern=pattern)


def layer_types_of(layers: list[TransformerLayerConfig], require: Require) -> tuple[list[str], Optional[int]]:
    """HF's ``layer_types`` of ``layers`` and the one window of their sliding ones (None if none slides)."""
    masks = [layer.attention.mask for layer in layers]
    require(
        all(type(mask) in (CausalMaskConfig, SlidingWindowMaskConfig) for mask in masks),
        f"attention masks {sorted({type(mask).__name__ for mask in masks})} (causal and sliding-window ones only)",
    )
    windows = {mask.window for mask in masks if isinstance(mask, SlidingWindowMaskConfig)}
    require(len(windows) <= 1, f"sliding windows of several sizes {sorted(windows)} (it has one)")
    types = [SLIDING if isinstance(mask, SlidingWindowMaskConfig) else FULL for mask in masks]
    return types, next(iter(windows), None)


def with_layer_types(
    family: Family,
    read: Callable[[Getter], tuple[list[str], Optional[int]]],
    write: Callable[[list[str], Optional[int]], dict[str, Any]],
) -> Family:
    """``family`` (whose own ``mask`` is causal) with layers that may each slide or not.

    ``read(get)``: the HF config's ``layer_types`` and window; ``write(types, window)``: the
    ``config.json`` fields that say them. Export refuses layers that differ in more than their mask.
    """
    require = requirement(family.architecture)

    def config_from_hf(get: Getter) -> CausalLMConfig:
        config = family.config_from_hf(get)
        types, window = read(get)
        return dataclasses.replace(config, decoder=decoder_with_layer_types(config.decoder, types, window))

    def config_to_hf(config: CausalLMConfig) -> dict[str, Any]:
        layers = config.decoder.layer_configs()
        types, window = layer_types_of(layers, require)
        causal = [
            dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, mask=CausalMaskConfig()))
            for layer in layers
        ]
        require(all(layer == causal[0] for layer in causal), "layers that differ in more than their attention mask")
        uniform = dataclasses.replace(config.decoder, layer=causal[0], variants={}, pattern=[])
        return {**family.config_to_hf(dataclasses.replace(config, decoder=uniform)), **write(types, window)}

    return dataclasses.replace(family, config_from_hf=config_from_hf, config_to_hf=config_to_hf)


def from_max_window_layers(layer: int, max_window_layers: int) -> bool:
    """Qwen2's and Qwen3's rule (transformers' ``Qwen2Config``): layers from ``max_window_layers`` on slide."""
    return layer >= max_window_layers


def with_qwen_windows(family: Family, slides: SlidingRule = from_max_window_layers) -> Family:
    """``family`` with Qwen's windows (``qwen_layer_types``); ``slides``: its rule for configs without
    ``layer_types``."""
    return with_layer_types(
        family,
        read=lambda get: qwen_layer_types(get, slides),
        write=lambda types, window: qwen_window_fields(types, window, slides),
    )


def refuse_sliding_window(hf: Mapping[str, Any]) -> Optional[str]:
    """``GGUFLayout.refuses`` for a llama.cpp architecture without sliding windows (Qwen's: their
    GGUF files hold no window, and llama.cpp and transformers attend to the whole context)."""
    if not hf.get("use_sliding_window"):
        return None
    return f"a sliding window (layer_types={hf.get('layer_types')}; it attends to the whole context in every layer)"
