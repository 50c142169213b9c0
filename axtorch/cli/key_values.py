"""The one argument style of every axtorch command: ``key=value`` into a typed config dataclass.

An unknown key is a ``ConfigError`` that suggests the nearest known one, as training's overrides
do; a value of the wrong type is one that names the key. A string key takes its value as
written; a list key also takes its items separated by commas (``metrics=train/loss,eval/loss``),
which needs no shell quoting. ``--help`` lists the keys with their types, defaults and the ``#:``
comment above each field.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import shlex
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from axtorch.compose.experiment_loader import check_keys_exist
from axtorch.config.errors import ConfigError
from axtorch.config.serialize import to_object
from axtorch.train.experiment import ExperimentConfig

T = TypeVar("T")

HELP_FLAGS = ("-h", "--help")


class CommandConfig(Protocol):
    """A command's config dataclass: the cross-field checks ``key=value`` typing cannot express."""

    def validate(self) -> None: ...


C = TypeVar("C", bound=CommandConfig)


def read_config(
    prog: str, argv: Sequence[str] | None, schema: type[C], description: str, old: OldStyle | None = None
) -> C | None:
    """The command's checked config from ``argv`` (default: ``sys.argv[1:]``); ``None`` once ``--help`` is printed.

    ``old`` maps the command's argparse-era arguments (:func:`modernize`).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if asks_for_help(argv):
        print(format_help(prog, description, schema))
        return None
    config = parse_key_values(argv if old is None else modernize(prog, argv, schema, old), schema)
    config.validate()
    return config


def asks_for_help(argv: Sequence[str]) -> bool:
    return any(arg in HELP_FLAGS for arg in argv)


def parse_key_values(argv: Sequence[str], schema: type[T]) -> T:
    """``argv``'s ``key=value`` items over ``schema``'s defaults; a bad key or value is a ``ConfigError``."""
    structured = OmegaConf.structured(schema)
    check_keys_exist(structured, argv)
    dotlist = [_typed_item(arg, schema) for arg in argv]
    try:
        return to_object(OmegaConf.merge(structured, OmegaConf.from_dotlist(dotlist)), schema)
    except OmegaConfBaseException as error:
        raise ConfigError(
            getattr(error, "full_key", "?") or "?",
            list(argv),
            "values of the declared types",
            reason=str(error).splitlines()[0],
        ) from error


def split_own_keys(argv: Sequence[str], schema: type) -> tuple[list[str], list[str]]:
    """(``argv``'s items whose top-level key is a field of ``schema``, the training overrides) in order.

    A key that is neither (``bacth=2``) but close to one of ``schema``'s is a ``ConfigError`` that
    suggests it, where training's check would only list the experiment's keys.
    """
    names = [f.name for f in dataclasses.fields(schema)]
    experiment = {f.name for f in dataclasses.fields(ExperimentConfig)}
    own = [arg for arg in argv if arg.partition("=")[0].split(".")[0] in names]
    for arg in argv:
        key, _, value = arg.partition("=")
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
        if arg not in own and key not in experiment and close:
            allowed = f"{names} or the experiment's keys {sorted(experiment)}"
            raise ConfigError(key, value, allowed, reason=f"no such key (did you mean {close[0]}?)")
    return own, [arg for arg in argv if arg not in own]


def _typed_item(arg: str, schema: type) -> str:
    """``arg`` as OmegaConf should read it: a string key's value verbatim (``title=Loss: runs``, not a
    mapping), a list key's ``a,b`` as ``["a", "b"]``; ``null`` and bracketed or quoted values unchanged."""
    key, _, value = arg.partition("=")
    hint = _hint_of(schema, key)
    if hint is None or value == "null" or value[:1] in ('"', "'", "["):
        return arg
    if typing.get_origin(hint) is list:
        return f"{key}={json.dumps(value.split(',') if value else [])}"
    if str in (hint, *typing.get_args(hint)):
        return f"{key}={json.dumps(value)}"
    return arg


def _hint_of(schema: type, key: str) -> Any:
    """The declared type of the dotted ``key`` in ``schema``, or None if there is no such key."""
    hint: Any = schema
    for part in key.split("."):
        types = _field_types(hint) if isinstance(hint, type) and dataclasses.is_dataclass(hint) else {}
        if part not in types:
            return None
        hint = types[part]
    return hint


def _field_types(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


@dataclass(frozen=True)
class KeyDoc:
    key: str
    type: str
    default: str
    doc: str


def key_docs(schema: type, prefix: str = "") -> list[KeyDoc]:
    """Every key of ``schema`` (nested dataclasses as dotted keys), from its fields and ``#:`` comments."""
    comments = _field_comments(schema)
    types = _field_types(schema)
    docs: list[KeyDoc] = []
    for each in dataclasses.fields(schema):
        hint = types[each.name]
        if dataclasses.is_dataclass(hint):
            docs.extend(key_docs(typing.cast(type, hint), f"{prefix}{each.name}."))
            continue
        default: Any = each.default
        if each.default_factory is not dataclasses.MISSING:
            default = each.default_factory()
        docs.append(KeyDoc(prefix + each.name, _type_name(hint), _as_typed(default), comments.get(each.name, "")))
    return docs


def _as_typed(default: Any) -> str:
    """A default as a user would type it on the command line."""
    if default is dataclasses.MISSING:
        return "(required)"
    if default is None:
        return "null"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, list):
        return ",".join(map(str, default)) if default else "[]"
    return str(default)


def _type_name(hint: Any) -> str:
    arguments = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union:  # Optional[X]
        return f"{_type_name(arguments[0])} or null"
    if typing.get_origin(hint) is list:
        return f"list of {_type_name(arguments[0])}"
    return getattr(hint, "__name__", str(hint))


def _field_comments(schema: type) -> dict[str, str]:
    """The ``#:`` comment lines right above each field of ``schema``'s class body, joined."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(schema).splitlines()[1:]:
        text = line.strip()
        if text.startswith("#:"):
            pending.append(text[2:].strip())
        elif ":" in text and text.split(":")[0].isidentifier() and pending:
            comments[text.split(":")[0]] = " ".join(pending)
            pending = []
        else:
            pending = []
    return comments


def format_help(prog: str, description: str, schema: type, usage: str = "") -> str:
    """``--help`` of a command: what it does, how it is called, then one line per key."""
    rows = key_docs(schema)
    width = max(len(f"{row.key}={row.default}") for row in rows)
    lines = [description.strip(), "", f"usage: {prog} {usage or 'key=value ...'}".rstrip(), "", "keys:"]
    for row in rows:
        lines.append(f"  {row.key + '=' + row.default:<{width}}  ({row.type}) {row.doc}".rstrip())
    return "\n".join(lines)


@dataclass(frozen=True)
class OldStyle:
    """A command's argparse-era arguments, kept for one release: bare words and ``--flags`` mapped to keys.

    ``positional`` names the keys of the leading bare words in order (a list key takes all that
    remain); ``options`` maps each ``--flag`` to a key (a bool key is a switch, a list key takes
    the words up to the next flag, any other key the next word).
    """

    positional: tuple[str, ...] = ()
    options: Mapping[str, str] = field(default_factory=dict)
    #: Flags mapped without a deprecation note: ``--config-dir``, shared with ``axtorch-train``.
    kept: tuple[str, ...] = ()


def modernize(prog: str, argv: Sequence[str], schema: type, old: OldStyle) -> list[str]:
    """``argv`` in ``key=value`` form; old-style arguments are mapped, and a note on stderr shows the new form."""
    types = _field_types(schema)
    items: list[str] = []  # JSON values: any path or title survives OmegaConf's parsing
    written: list[str] = []  # as the user would type them
    lists: dict[str, list[str]] = {}
    deprecated = False
    positional = list(old.positional)
    args = list(argv)
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        flag, has_value, inline = arg.partition("=")
        if not arg.startswith("-") and has_value:
            items.append(arg)
            written.append(shlex.quote(arg))
        elif flag in old.options:
            key = old.options[flag]
            deprecated = deprecated or flag not in old.kept
            if types[key] is bool:
                items.append(f"{key}=true")
                written.append(f"{key}=true")
                continue
            taken = [inline] if has_value else []
            while not has_value and index < len(args) and not args[index].startswith("-") and "=" not in args[index]:
                taken.append(args[index])
                index += 1
                if typing.get_origin(types[key]) is not list:
                    break
            if typing.get_origin(types[key]) is list:
                lists.setdefault(key, []).extend(taken)
            else:
                items.append(f"{key}={json.dumps(taken[0] if taken else '')}")
                written.append(shlex.quote(f"{key}={taken[0] if taken else ''}"))
        elif not arg.startswith("-") and positional:
            deprecated = True
            if typing.get_origin(types[positional[0]]) is list:
                lists.setdefault(positional[0], []).append(arg)
            else:
                items.append(f"{positional[0]}={json.dumps(arg)}")
                written.append(shlex.quote(f"{positional.pop(0)}={arg}"))
        else:
            raise ConfigError(arg, None, f"key=value items, keys: {[doc.key for doc in key_docs(schema)]}")
    items.extend(f"{key}={json.dumps(values)}" for key, values in lists.items())
    written.extend(shlex.quote(f"{key}={','.join(values)}") for key, values in lists.items())
    if deprecated:
        print(
            f"{prog}: bare arguments and --flags are deprecated and go in the next release; "
            f"write: {prog} {' '.join(written)}",
            file=sys.stderr,
        )
    return items
