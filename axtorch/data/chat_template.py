"""A Hugging Face chat template rendered as transformers' ``apply_chat_template`` renders it.

A sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension and the ``{% generation %}`` tag, the globals ``raise_exception`` and
``strftime_now``, its ``tojson`` filter, and the special tokens (``bos_token``, ``eos_token``,
...) as variables. Both the tokenizer (a prompt for generation) and the chat data (the
assistant's tokens of a conversation) render through it; it needs no tokenizer of its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any, Optional, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import numpy as np

from axtorch.config.errors import ConfigError

Message = dict[str, str]
Span = tuple[int, int]


class OffsetsEncoder(Protocol):
    """What encoding a rendered conversation needs of a tokenizer (``axtorch.data.tokenizer.Tokenizer``)."""

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...


class _GenerationSpans(jinja2.ext.Extension):
    """The ``{% generation %}`` tag: records the character span of what its body renders."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance variable)

    def __init__(self, environment: jinja2.Environment):
        super().__init__(environment)
        self.tracking: ContextVar[Optional[tuple[list[str], list[Span]]]] = ContextVar("generation", default=None)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_record", []), [], [], body).set_lineno(lineno)

    def _record(self, caller: Any) -> str:
        text = caller()
        tracking = self.tracking.get()
        if tracking is not None:
            rendered, spans = tracking
            start = len("".join(rendered))
            spans.append((start, start + len(text)))
        return str(text)

    @contextmanager
    def track(self, rendered: list[str], spans: list[Span]) -> Iterator[None]:
        token = self.tracking.set((rendered, spans))
        try:
            yield
        finally:
            self.tracking.reset(token)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Optional[int] = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it may name (``bos_token``, ``eos_token``, ...)."""

    source: str
    special_tokens: dict[str, str]

    @classmethod
    def from_settings(cls, settings: dict[str, Any], where: str) -> ChatTemplate:
        """From a ``tokenizer_config.json``'s contents (``chat_template``, ``*_token`` entries)."""
        template = settings.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((entry["template"] for entry in template if entry.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ConfigError(
                "data.source.template",
                None,
                "a tokenizer_config.json or .jinja file with a chat template",
                reason=f"{where} has no chat_template",
            )
        tokens = {}
        for name, value in settings.items():
            content = value.get("content") if isinstance(value, dict) else value
            if name.endswith("_token") and isinstance(content, str):
                tokens[name] = content
        return cls(template, tokens)

    @cached_property
    def _compiled(self) -> tuple[jinja2.Template, _GenerationSpans]:
        """Compiled once per template: a conversation renders once per assistant turn, twice."""
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationSpans, jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        tracker = environment.extensions[_GenerationSpans.identifier]
        assert isinstance(tracker, _GenerationSpans)
        return environment.from_string(self.source), tracker

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> tuple[str, list[Span]]:
        """The conversation as text, and the spans its ``{% generation %}`` blocks rendered."""
        template, tracker = self._compiled
        rendered: list[str] = []
        spans: list[Span] = []
        variables = {**self.special_tokens, "messages": messages, "add_generation_prompt": add_generation_prompt}
        with tracker.track(rendered, spans):
            for block in template.generate(tools=None, documents=None, **variables):
                rendered.append(block)
        return "".join(rendered), spans

    @property
    def marks_generation(self) -> bool:
        """Whether the template wraps the assistant's output in ``{% generation %}``."""
        return re.search(r"\{%-?\s*generation\s*-?%\}", self.source) is not None

    def assistant_spans(self, messages: list[Message]) -> tuple[str, list[Span]]:
        """The rendered conversation and the character spans of its assistant turns."""
        text, spans = self.render(messages)
        if self.marks_generation:
            return text, spans
        spans = []
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, _ = self.render(messages[:turn], add_generation_prompt=True)
            through, _ = self.render(messages[: turn + 1])
            if not (through.startswith(prompt) and text.startswith(through)):
                raise ValueError(
                    f"the chat template renders turn {turn} differently once later turns follow, so its "
                    "assistant tokens cannot be found by rendering; wrap them in {% generation %} ... "
                    "{% endgeneration %} in the template (data.source.template)"
                )
            spans.append((len(prompt), len(through)))
        return text, spans

    def encode(self, messages: list[Message], tokenizer: OffsetsEncoder) -> tuple[list[int], np.ndarray]:
        """The conversation's token ids and which of them are the assistant's (bool)."""
        text, spans = self.assistant_spans(messages)
        ids, offsets = tokenizer.encode_with_offsets(text)
        targets = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            targets |= np.array([begin < end and finish > start for begin, finish in offsets], dtype=bool)
        return ids, targets
