"""The adapter contract: what interop knows of one HF model family.

A family is data, not a subclass: each ``families/<name>.py`` builds one ``Family`` from
functions, and the registry (``families/__init__.py``) lists them. HF import and export, GGUF
import and export and ``init_from`` all go through the registry, so a new family is one file
and one registry line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from axtorch.models.causal_lm import CausalLMConfig

NamedTensor = tuple[str, torch.Tensor]
#: Reads a HF config field, with a default: ``get("rope_theta", 10000.0)``, from a ``config.json``
#: dict or a transformers config object alike.
Getter = Callable[..., Any]


class CannotExpress(ValueError):
    """A family cannot express a model; the message names the first feature it lacks."""


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp stores the family: its ``general.architecture`` and what sets it apart there."""

    architecture: str
    #: llama.cpp's converter reorders the Q/K rows of ``llama`` files for its interleaved RoPE.
    interleaved_qk: bool = False
    #: What llama.cpp's converter adds to the family's HF norm weights (Gemma's 1: it stores the
    #: ``1 + weight`` its norms multiply by).
    norm_offset: float = 0.0
    #: The family's HF config fields from the GGUF's ``<architecture>.*`` metadata (beyond the
    #: shared Llama layout's): ``key(name, default)`` reads one; ``{}`` when there are none.
    config_fields: Callable[[Getter], dict[str, Any]] = lambda key: {}
    #: The inverse: GGUF metadata (names without the architecture prefix) for the family's HF config.
    metadata: Callable[[Mapping[str, Any]], dict[str, Any]] = lambda hf: {}
    #: Whether a GGUF of this architecture holds this family, from the HF fields read so far
    #: (e.g. Mixtral is a ``llama`` file with experts).
    holds: Callable[[Mapping[str, Any]], bool] = lambda hf: True
    #: What llama.cpp's fixed behaviour for the architecture cannot express of a HF config (e.g.
    #: top-k weights it always renormalises), or None.
    refuses: Callable[[Mapping[str, Any]], Optional[str]] = lambda hf: None
    #: (GGUF layer tensor, HF module) names of the architecture that differ from the shared ones
    #: (``gguf.LAYER_NAMES``): Gemma 2's ``ffn_norm`` is HF's ``pre_feedforward_layernorm``.
    layer_names: tuple[tuple[str, str], ...] = ()
    #: The family's own (HF, axtorch) parameter names (``llama_layout.NameTemplates``), which GGUF
    #: export renames with as the family does.
    hf_names: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Family:
    """One HF model family: its config and tensors both ways, and what it can express."""

    #: HF ``config.json`` ``model_type``.
    model_type: str
    #: HF ``architectures`` entry, the class ``transformers`` builds.
    architecture: str
    #: An axtorch config equal in function to the family's HF config; ``ValueError`` naming a
    #: field axtorch cannot honour.
    config_from_hf: Callable[[Getter], CausalLMConfig]
    #: The family's ``config.json`` dict for an axtorch config; ``CannotExpress`` otherwise.
    config_to_hf: Callable[[CausalLMConfig], dict[str, Any]]
    #: HF-named tensors (any of the family's layouts) -> axtorch-named ones, lazily.
    tensors_from_hf: Callable[[CausalLMConfig, Iterable[NamedTensor]], Iterator[NamedTensor]]
    #: axtorch-named tensors -> the family's names and layout on the hub.
    tensors_to_hf: Callable[[CausalLMConfig, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
    #: None for a family llama.cpp does not run.
    gguf: Optional[GGUFLayout] = None


def getter(hf: Mapping[str, Any] | Any) -> Getter:
    """``get(key, default)`` over a ``config.json`` dict or a transformers config object."""
    if isinstance(hf, Mapping):
        return lambda key, default=None: hf.get(key, default)
    return lambda key, default=None: getattr(hf, key, default)


def requirement(architecture: str) -> Callable[[bool, str], None]:
    """``require(condition, feature)``: raise ``CannotExpress`` naming ``feature`` unless ``condition``."""

    def require(condition: bool, feature: str) -> None:
        if not condition:
            raise CannotExpress(f"HF {architecture} cannot express this model: {feature}")

    return require
