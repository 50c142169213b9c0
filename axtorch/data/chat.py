"""Chat SFT data (``data=chat``): rows of ``messages`` rendered with the model's own chat template,
the loss taken on the assistant's tokens only.

Rendering follows transformers' ``apply_chat_template`` (``chat_template.py``); the text is
tokenized without adding special tokens, as ``apply_chat_template(tokenize=True)`` does.

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from omegaconf import MISSING

import axtorch.data.parquet  # noqa: F401 (registers the Parquet row reader)
from axtorch.config.errors import ConfigError
from axtorch.data.chat_template import ChatTemplate
from axtorch.data.document_tokens import flag_document
from axtorch.data.sources import PartitionedSource, SourceConfig, read_rows, resolve_globs
from axtorch.data.tokenizer import TOKENIZER_SETTINGS_FILE, Tokenizer


def load_chat_template(path: str, tokenizer: Tokenizer) -> ChatTemplate:
    """A ``.jinja`` file (special tokens: the tokenizer's), a ``tokenizer_config.json``, or a directory with one."""
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / TOKENIZER_SETTINGS_FILE
    if not file.is_file():
        raise ConfigError("data.source.template", path, "a .jinja file, a tokenizer_config.json or its directory")
    if file.suffix == ".jinja":
        settings = {"eos_token": tokenizer.eos_token, **tokenizer.settings, "chat_template": file.read_text()}
        return ChatTemplate.from_settings(settings, str(file))
    return ChatTemplate.from_settings(json.loads(file.read_text()), str(file))


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
                template = load_chat_template(self.template, tokenizer)
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
