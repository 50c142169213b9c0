"""Chat SFT data (``data=chat``): rows of ``messages`` rendered with the model's own chat template,
the loss taken on the assistant's tokens only.

Rendering follows transformers' ``apply_chat_template``: a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and the ``{% generation %}``
tag, the globals ``raise_exception`` and ``strftime_now``, its ``tojson`` filter, and the special
tokens (``bos_token``, ``eos_token``, ...) as variables; the text is tokenized without adding
special tokens, as ``apply_chat_template(tokenize=True)`` does.

The assistant's characters are found by rendering. A template that wraps them in
``{% generation %}`` gives their spans directly (transformers' ``return_assistant_tokens_mask``);
otherwise an assistant turn's span is what rendering the conversation up to it adds to
rendering the turns before it with ``add_generation_prompt=True``: its content and its
end-of-turn marker, which the model must learn to emit. A token is a target when it overlaps a
span. The template comes from ``tokenizer_config.json`` beside the tokenizer (an HF directory;
``init_from=gguf:`` writes one from the GGUF's ``tokenizer.chat_template``) or ``data.source.template``.
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
from pathlib import Path
from typing import Any, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import numpy as np
from omegaconf import MISSING

import axtorch.data.parquet  # noqa: F401 (registers the Parquet row reader)
from axtorch.config.errors import ConfigError
from axtorch.data.document_tokens import flag_document
from axtorch.data.sources import PartitionedSource, SourceConfig, read_rows, resolve_globs
from axtorch.data.tokenizer import TOKENIZER_SETTINGS_FILE, Tokenizer

Message = dict[str, str]
Span = tuple[int, int]


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

    @classmethod
    def load(cls, path: str, tokenizer: Tokenizer) -> ChatTemplate:
        """A ``.jinja`` file (special tokens: the tokenizer's), a ``tokenizer_config.json``, or a directory with one."""
        file = Path(path).expanduser()
        if file.is_dir():
            file = file / TOKENIZER_SETTINGS_FILE
        if not file.is_file():
            raise ConfigError("data.source.template", path, "a .jinja file, a tokenizer_config.json or its directory")
        if file.suffix == ".jinja":
            settings = {"eos_token": tokenizer.eos_token, **tokenizer.settings, "chat_template": file.read_text()}
            return cls.from_settings(settings, str(file))
        return cls.from_settings(json.loads(file.read_text()), str(file))

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

    def encode(self, messages: list[Message], tokenizer: Tokenizer) -> tuple[list[int], np.ndarray]:
        """The conversation's token ids and which of them are the assistant's (bool)."""
        text, spans = self.assistant_spans(messages)
        ids, offsets = tokenizer.encode_with_offsets(text)
        targets = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            targets |= np.array([begin < end and finish > start for begin, finish in offsets], dtype=bool)
        return ids, targets


def messages_document(value: Any, field: str, where: str) -> str:
    """A row's ``messages`` (a list of ``{role, content}`` strings) as one document: canonical JSON."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: field {field!r} is {type(value).__name__}, not a non-empty list of messages")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: {field}[{index}] is not a message with a string 'role': {message!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: {field}[{index}] ({message['role']}) has no string 'content'")
        messages.append({"role": message["role"], "content": message["content"]})
    return json.dumps(messages, ensure_ascii=False)


class ChatSource(PartitionedSource):
    """Conversations from JSONL or Parquet rows (``reader``), encoded with a chat template."""

    def __init__(self, reader: PartitionedSource, template: Optional[str]):
        self.reader = reader
        self.template = template
        self._templates: dict[int, ChatTemplate] = {}

    def read_part(self, part: int, parts: int, position: int) -> Iterator[tuple[str, int]]:
        return self.reader.read_part(part, parts, position)

    def fingerprint(self) -> str:
        return f"chat:{self.reader.fingerprint()}"

    def chat_template(self, tokenizer: Tokenizer) -> ChatTemplate:
        """``data.source.template``, else the tokenizer's own (its ``tokenizer_config.json``)."""
        if id(tokenizer) not in self._templates:
            if self.template is not None:
                template = ChatTemplate.load(self.template, tokenizer)
            else:
                template = ChatTemplate.from_settings(tokenizer.settings, "the tokenizer's tokenizer_config.json")
            self._templates[id(tokenizer)] = template
        return self._templates[id(tokenizer)]

    def encode_documents(self, documents: list[str], tokenizer: Tokenizer, mark_starts: bool) -> list[np.ndarray]:
        """Each conversation as the template renders it, ``NOT_TARGET`` outside the assistant's turns."""
        template = self.chat_template(tokenizer)
        encoded = []
        for document in documents:
            ids, targets = template.encode(json.loads(document), tokenizer)
            encoded.append(flag_document(ids, targets, mark_start=mark_starts))
        return encoded


@dataclass
class ChatSourceConfig(SourceConfig):
    """JSONL or Parquet (by extension) rows of chat ``messages``, always streamed (``data=chat``).

    ``template`` (null: the tokenizer's own ``tokenizer_config.json``) is a ``.jinja`` file, a
    ``tokenizer_config.json`` or its directory.
    """

    paths: list[str] = MISSING
    messages_field: str = "messages"
    template: Optional[str] = None

    def build(self) -> ChatSource:
        files = resolve_globs(self.paths, "data.source.paths")
        rows = read_rows(files, self.messages_field, messages_document, "data.source.messages_field")
        return ChatSource(rows, self.template)

    def build_streaming(self) -> ChatSource:
        return self.build()
