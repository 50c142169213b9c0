"""A thin wrapper over Hugging Face ``tokenizers``: load a ``tokenizer.json`` or train a byte-level BPE.

Training is cached per corpus so a second run with the same data starts at once, and the trained
file is what the trainer copies into the run directory for generation and export.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from axtorch.config.errors import ConfigError
from axtorch.data.chat_template import ChatTemplate
from axtorch.data.files import stable_hash, write_file_atomically

TOKENIZER_FILE = "tokenizer.json"
#: Beside a tokenizer.json: its special tokens and chat template, as HF writes them.
TOKENIZER_SETTINGS_FILE = "tokenizer_config.json"
#: Beside a tokenizer.json: the chat template, where transformers 5 saves it (older releases put it
#: in tokenizer_config.json's ``chat_template``, which wins when both are there).
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: Beside a tokenizer.json: the ids that end generation (``eos_token_id``), as HF writes them.
GENERATION_SETTINGS_FILE = "generation_config.json"
#: The end-of-text token of a tokenizer that names none (one trained here).
DEFAULT_EOS_TOKEN = "<|endoftext|>"


@dataclass
class TokenizerConfig:
    """Either a ``tokenizer.json`` to load (``path``) or the settings for training one on the corpus.

    ``eos_token`` ends every packed document; null: the tokenizer's own (the ``eos_token`` of the
    ``tokenizer_config.json`` beside it, as an imported model's, ``init_from``, has), else
    ``<|endoftext|>`` (the token a trained tokenizer gets).
    """

    path: Optional[str] = None
    vocab_size: int = 8192
    train_max_bytes: int = 8_000_000
    eos_token: Optional[str] = None


def _token_text(value: Any) -> Optional[str]:
    """A special token as ``tokenizer_config.json`` writes it: its text, or ``{"content": text, ...}``."""
    content = value.get("content") if isinstance(value, dict) else value
    return content if isinstance(content, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_text(path: Path, text: str) -> None:
    encoded = text.encode("utf-8")
    write_file_atomically(path, lambda file: file.write(encoded))


class Tokenizer:
    """Text <-> token ids, with the special tokens the model's own tokenizer adds and ends with.

    A packed document is ``bos_id`` (None unless the model's tokenizer adds one: its
    ``tokenizer_config.json``'s ``add_bos_token``, else its post-processor), its text's ids, and
    ``eos_id``. ``stop_ids`` end a generated reply: EOS and the model's end-of-turn tokens (HF's
    ``generation_config.json`` ``eos_token_id``, a GGUF's end-of-generation tokens), which
    ``save`` writes back beside the tokenizer.
    """

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        eos_token: Optional[str] = None,
        settings: Optional[dict[str, Any]] = None,
        stop_ids: Iterable[int] = (),
    ):
        #: The ``tokenizer_config.json`` beside the loaded file (special tokens, chat template), or {}.
        self.settings: dict[str, Any] = settings or {}
        eos_token = eos_token or _token_text(self.settings.get("eos_token")) or DEFAULT_EOS_TOKEN
        eos_id = inner.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(
                f"tokenizer has no token {eos_token!r}; set data.tokenizer.eos_token to its end-of-text token"
            )
        self._inner = inner
        self._eos_id = eos_id
        self.eos_token = eos_token
        self.bos_id = self._added_bos_id()
        self.stop_ids: tuple[int, ...] = tuple(sorted({eos_id, *stop_ids}))

    def _added_bos_id(self) -> Optional[int]:
        """What transformers' tokenizer puts first: ``add_bos_token`` and ``bos_token`` where the
        settings say, else the token the post-processor adds before a text (``tokenizer.json``)."""
        if "add_bos_token" in self.settings:
            bos_token = _token_text(self.settings.get("bos_token"))
            if not self.settings["add_bos_token"] or bos_token is None:
                return None
            bos_id = self._inner.token_to_id(bos_token)
            if bos_id is None:
                raise ValueError(f"the tokenizer adds bos_token {bos_token!r}, which is not in its vocabulary")
            return int(bos_id)
        plain = self._inner.encode("a", add_special_tokens=False).ids
        special = self._inner.encode("a", add_special_tokens=True).ids
        return special[0] if len(special) > len(plain) and special[: len(plain)] != plain else None

    @classmethod
    def load(cls, path: str | os.PathLike[str], eos_token: Optional[str] = None) -> Tokenizer:
        """``path`` with the ``tokenizer_config.json``, ``chat_template.jinja`` and ``generation_config.json``
        beside it, if any."""
        directory = Path(path).parent
        settings = _read_json(directory / TOKENIZER_SETTINGS_FILE)
        template = directory / CHAT_TEMPLATE_FILE
        if "chat_template" not in settings and template.is_file():
            settings["chat_template"] = template.read_text()
        ends = _read_json(directory / GENERATION_SETTINGS_FILE).get("eos_token_id", [])
        stop_ids = ends if isinstance(ends, list) else [ends]
        return cls(tokenizers.Tokenizer.from_file(str(path)), eos_token, settings, stop_ids)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically, so a crash never leaves a half-written file that a later run would load;
        the settings and end-of-turn ids (if any) go beside it, where ``load`` reads them."""
        _write_text(Path(path), self._inner.to_str(pretty=True))
        if self.settings:
            _write_text(Path(path).parent / TOKENIZER_SETTINGS_FILE, json.dumps(self.settings, indent=2))
        if self.stop_ids != (self.eos_id,):
            ends = json.dumps({"eos_token_id": list(self.stop_ids)}, indent=2)
            _write_text(Path(path).parent / GENERATION_SETTINGS_FILE, ends)

    def description(self) -> dict[str, Any]:
        """The ``tokenizers`` JSON description: model, vocabulary, merges, pre-tokenizer, added tokens."""
        return json.loads(self._inner.to_str())

    # Special tokens are never added: packing adds BOS and EOS itself, and decode is the exact inverse.
    def encode(self, text: str) -> list[int]:
        return self._inner.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._inner.encode_batch(texts, add_special_tokens=False)]

    def document_ids(self, texts: list[str]) -> list[list[int]]:
        """Each text as one packed document: BOS (when the model's tokenizer adds one), its ids, EOS."""
        head = [] if self.bos_id is None else [self.bos_id]
        return [[*head, *ids, self._eos_id] for ids in self.encode_batch(texts)]

    def document_text(self, ids: Sequence[int]) -> str:
        """The text of one document of ``document_ids``: its BOS and EOS removed."""
        start = int(self.bos_id is not None and len(ids) > 0 and ids[0] == self.bos_id)
        end = len(ids) - int(len(ids) > start and ids[-1] == self._eos_id)
        return self.decode(ids[start:end])

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids and each token's character span in ``text``."""
        encoding = self._inner.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Iterable[int]) -> str:
        return self._inner.decode(list(ids), skip_special_tokens=False)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """``messages`` through the model's chat template, the assistant's turn opened (as
        transformers' ``apply_chat_template(add_generation_prompt=True)`` renders them)."""
        text, _ = self._chat_template.render(messages, add_generation_prompt=True)
        return text

    @cached_property
    def _chat_template(self) -> ChatTemplate:
        if not isinstance(self.settings.get("chat_template"), (str, list)):
            raise ValueError(
                "the tokenizer has no chat template (an HF directory's or a run's tokenizer_config.json "
                "chat_template, a GGUF's tokenizer.chat_template)"
            )
        return ChatTemplate.from_settings(self.settings, "the tokenizer's tokenizer_config.json")

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, including special tokens: the embedding table size a model needs."""
        return self._inner.get_vocab_size(with_added_tokens=True)


def validate_tokenizer_config(cfg: TokenizerConfig) -> None:
    """Reject settings that cannot work, before any file is read."""
    if cfg.path is not None and not Path(cfg.path).expanduser().is_file():
        raise ConfigError("data.tokenizer.path", cfg.path, "null (train one) or an existing tokenizer.json")
    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + 1
    if cfg.path is None and cfg.vocab_size <= minimum:
        raise ConfigError(
            "data.tokenizer.vocab_size",
            cfg.vocab_size,
            f"an integer > {minimum}",
            "a byte-level BPE needs 256 byte tokens plus the EOS token before any merge",
        )
    if cfg.train_max_bytes < 1:
        raise ConfigError("data.tokenizer.train_max_bytes", cfg.train_max_bytes, "an integer >= 1")
    if cfg.eos_token == "":
        raise ConfigError("data.tokenizer.eos_token", cfg.eos_token, "null (the tokenizer's own) or a non-empty string")


def tokenizer_fingerprint(cfg: TokenizerConfig) -> str:
    """Identifies the tokenizer ``cfg`` yields for a given corpus: file content (with the settings
    files beside it, which choose its BOS and EOS), or training settings."""
    eos_token = cfg.eos_token or DEFAULT_EOS_TOKEN
    if cfg.path is not None:
        path = Path(cfg.path).expanduser()
        files = [path] + [path.parent / name for name in (TOKENIZER_SETTINGS_FILE, GENERATION_SETTINGS_FILE)]
        contents = [hashlib.sha256(file.read_bytes()).hexdigest() for file in files if file.is_file()]
        return stable_hash("file", *contents, eos_token)
    return stable_hash("bpe", cfg.vocab_size, cfg.train_max_bytes, eos_token)


def train_byte_level_bpe(texts: Iterator[str], vocab_size: int, eos_token: str) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE: every byte is in the alphabet, so no text is unknown."""
    inner = tokenizers.Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(inner, eos_token)
