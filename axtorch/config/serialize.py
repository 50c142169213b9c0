"""Round-trip a typed config through YAML, keeping which implementation fills each slot.

Plain ``OmegaConf.to_yaml`` loses the concrete class of a polymorphic child (a
``GatedFeedForwardConfig`` in a ``FeedForwardConfig`` slot looks like any other mapping). Here a
node whose class differs from its field's declared type carries ``_type_: module.Class``, so a run
directory's ``config.yaml`` alone is enough to rebuild the exact model.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import typing
import warnings
from typing import Any, TypeVar

from omegaconf import OmegaConf

TYPE_KEY = "_type_"
#: Field metadata: the field is written only when non-empty, so that adding it to a config class
#: leaves the text (and digest) of every config that does not use it unchanged.
OMIT_WHEN_EMPTY = "omit_when_empty"
T = TypeVar("T")
#: Modules renamed since configs were written with their old names (old -> new). A ``_type_`` under
#: an old name still reads, with a FutureWarning, until the release after the rename.
MOVED_MODULES = {"axtorch.layers.position": "axtorch.layers.relative_position"}


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _import_class(path: str) -> type:
    """The config dataclass named by a ``_type_``: only an axtorch dataclass, so that a config file
    (a run directory's, perhaps someone else's) can never make axtorch import or call other code."""
    module, _, name = path.rpartition(".")
    if module in MOVED_MODULES:
        warnings.warn(
            f"{TYPE_KEY}: {path!r} names a module that was renamed to {MOVED_MODULES[module]!r}; it is read as "
            f"{MOVED_MODULES[module]}.{name} until the next release: write the new name",
            FutureWarning,
            stacklevel=2,
        )
        module = MOVED_MODULES[module]
    if module != "axtorch" and not module.startswith("axtorch."):
        raise ValueError(f"{TYPE_KEY}: {path!r} is not an axtorch config class")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"{TYPE_KEY}: {path!r} is not an axtorch config class")
    return cls


def with_former_module_names(config_text: str) -> str:
    """``config_text`` as it was written before the renames in ``MOVED_MODULES``: a checkpoint saved
    then records the digest of this text, and resuming it must still recognise the same model."""
    for old, new in MOVED_MODULES.items():
        config_text = config_text.replace(f"{TYPE_KEY}: {new}.", f"{TYPE_KEY}: {old}.")
    return config_text


def _declared_dataclass(annotation: Any) -> type | None:
    """The dataclass a field declares: ``SomeConfig``, ``Optional[SomeConfig]``, or the elements of
    ``list[SomeConfig]``; None for ``Any`` and plain values."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
        if typing.get_origin(candidate) is list:
            return _declared_dataclass(typing.get_args(candidate)[0])
    return None


def _to_plain(value: Any, declared: type | None) -> Any:
    if dataclasses.is_dataclass(value):
        hints = typing.get_type_hints(type(value))
        node: dict[str, Any] = {}
        if type(value) is not declared:  # a subclass, or a dataclass in a field typed Any
            node[TYPE_KEY] = _class_path(type(value))
        for field in dataclasses.fields(value):
            if field.metadata.get(OMIT_WHEN_EMPTY) and not getattr(value, field.name):
                continue
            node[field.name] = _to_plain(getattr(value, field.name), _declared_dataclass(hints[field.name]))
        return node
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_to_plain(v, declared) for v in value]
    if isinstance(value, dict):  # a mapping typed Any (decoder variants): its dataclasses carry _type_
        return {k: _to_plain(v, None) for k, v in value.items()}
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    return _to_plain(config, type(config))


def config_to_yaml(config: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(config_to_dict(config)))


def _typed_nodes(node: Any) -> Any:
    """Replace every mapping with a ``_type_`` by a structured node of that class."""
    if isinstance(node, dict):
        cls = _import_class(node[TYPE_KEY]) if TYPE_KEY in node else None
        children = {k: _typed_nodes(v) for k, v in node.items() if k != TYPE_KEY}
        if cls is None:
            return children
        return OmegaConf.merge(OmegaConf.structured(cls), children)
    if isinstance(node, list):
        return [_typed_nodes(v) for v in node]
    return node


def to_object(node: Any, schema: type[T]) -> T:
    """``OmegaConf.to_object`` of a structured config node of ``schema``, typed as such."""
    # OmegaConf annotates to_object with a loose union of every container type it can return.
    return typing.cast(T, OmegaConf.to_object(node))


def config_from_dict(data: dict[Any, Any], schema: type[T]) -> T:
    return to_object(OmegaConf.merge(OmegaConf.structured(schema), _typed_nodes(data)), schema)


def config_from_yaml(text: str, schema: type[T]) -> T:
    data = OmegaConf.to_container(OmegaConf.create(text))
    if not isinstance(data, dict):
        raise ValueError(f"config YAML is a {type(data).__name__}, not a mapping")
    return config_from_dict(data, schema)
