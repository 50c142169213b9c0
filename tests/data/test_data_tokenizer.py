"""Tokenizer: byte-level BPE training is deterministic, cached, and round-trips any text; a model's
tokenizer brings its BOS, EOS and end-of-turn ids (its tokenizer_config.json, generation_config.json)."""

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest
import tokenizers
from tokenizers import AddedToken, processors

from axtorch.config.errors import ConfigError
from axtorch.data import DocumentSource, Tokenizer, TokenizerConfig, load_or_train_tokenizer, shards
from axtorch.data.packing import tokenize_documents

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega"]
DOCUMENTS = [
    f"doc {i}: " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(25 + i % 9)) + ".\n" for i in range(30)
]


class ListSource(DocumentSource):
    """An in-memory corpus that counts how often it is read."""

    def __init__(self, documents: list[str]):
        self.documents = documents
        self.reads = 0

    def iter_documents(self) -> Iterator[str]:
        self.reads += 1
        yield from self.documents

    def fingerprint(self) -> str:
        return hashlib.sha256("\0".join(self.documents).encode()).hexdigest()


CONFIG = TokenizerConfig(vocab_size=300)


def test_train_save_load_round_trip(tmp_path):
    trained = load_or_train_tokenizer(CONFIG, ListSource(DOCUMENTS), tmp_path)
    loaded = Tokenizer.load(tmp_path / "tokenizer.json", CONFIG.eos_token)
    assert trained.vocab_size == loaded.vocab_size == 300
    assert trained.eos_id == loaded.eos_id
    assert loaded.encode(DOCUMENTS[3]) == trained.encode(DOCUMENTS[3])
    copy = tmp_path / "copy.json"
    loaded.save(copy)
    assert Tokenizer.load(copy, CONFIG.eos_token).encode(DOCUMENTS[0]) == trained.encode(DOCUMENTS[0])


@pytest.mark.parametrize("text", ["doc 1: alpha beta.\n", "naïve café — 日本語 🙂\n\tdef f(x):  return x\r\n", ""])
def test_encode_decode_round_trip(tmp_path, text):
    tokenizer = load_or_train_tokenizer(CONFIG, ListSource(DOCUMENTS), tmp_path)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_id not in ids
    assert tokenizer.encode_batch([text, "alpha"]) == [ids, tokenizer.encode("alpha")]


def test_training_is_deterministic(tmp_path):
    load_or_train_tokenizer(CONFIG, ListSource(DOCUMENTS), tmp_path / "a")
    load_or_train_tokenizer(CONFIG, ListSource(DOCUMENTS), tmp_path / "b")
    first = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert first == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_cached_tokenizer_is_reused(tmp_path):
    source = ListSource(DOCUMENTS)
    first = load_or_train_tokenizer(CONFIG, source, tmp_path)
    cached = tmp_path / "tokenizer.json"
    mtime = cached.stat().st_mtime_ns
    second = load_or_train_tokenizer(CONFIG, source, tmp_path)
    assert source.reads == 1
    assert cached.stat().st_mtime_ns == mtime
    assert second.encode(DOCUMENTS[5]) == first.encode(DOCUMENTS[5])


class FirstDocumentOnly(ListSource):
    """Fails if training reads beyond its first (long) document."""

    def iter_documents(self) -> Iterator[str]:
        yield DOCUMENTS[0] * 20
        raise AssertionError("read past train_max_bytes")


def test_training_reads_at_most_train_max_bytes(tmp_path):
    config = TokenizerConfig(vocab_size=280, train_max_bytes=len(DOCUMENTS[0]) * 10)
    assert load_or_train_tokenizer(config, FirstDocumentOnly([]), tmp_path).vocab_size > 257


def test_configured_path_is_loaded_and_copied_to_cache(tmp_path):
    load_or_train_tokenizer(CONFIG, ListSource(DOCUMENTS), tmp_path / "trained")
    path = str(tmp_path / "trained" / "tokenizer.json")
    source = ListSource(DOCUMENTS)
    tokenizer = load_or_train_tokenizer(TokenizerConfig(path=path), source, tmp_path / "cache")
    assert source.reads == 0
    assert (tmp_path / "cache" / "tokenizer.json").exists()
    assert tokenizer.decode(tokenizer.encode(DOCUMENTS[1])) == DOCUMENTS[1]


def test_loaded_tokenizer_without_eos_is_an_error(tmp_path):
    load_or_train_tokenizer(CONFIG, ListSource(DOCUMENTS), tmp_path)
    with pytest.raises(ValueError, match=r"no token '<\|eos\|>'.*data\.tokenizer\.eos_token"):
        Tokenizer.load(tmp_path / "tokenizer.json", "<|eos|>")


@pytest.mark.parametrize(
    ("config", "key"),
    [
        (TokenizerConfig(vocab_size=100), "data.tokenizer.vocab_size"),
        (TokenizerConfig(train_max_bytes=0), "data.tokenizer.train_max_bytes"),
        (TokenizerConfig(path="/no/such/tokenizer.json"), "data.tokenizer.path"),
        (TokenizerConfig(eos_token=""), "data.tokenizer.eos_token"),
    ],
)
def test_bad_tokenizer_config(tmp_path, config, key):
    with pytest.raises(ConfigError) as error:
        load_or_train_tokenizer(config, ListSource(DOCUMENTS), tmp_path)
    assert error.value.key == key


def _model_tokenizer_files(directory: Path, settings: dict, end_ids: Optional[list] = None, bos_template=False) -> Path:
    """A trained BPE with the special tokens <s> and <|im_end|>, and an HF-style tokenizer_config.json
    (and generation_config.json) beside it, as an imported model's tokenizer comes."""
    trained = load_or_train_tokenizer(CONFIG, ListSource(DOCUMENTS), directory / "trained")
    inner = tokenizers.Tokenizer.from_file(str(directory / "trained" / "tokenizer.json"))
    inner.add_special_tokens([AddedToken("<s>", special=True), AddedToken("<|im_end|>", special=True)])
    if bos_template:  # BOS from the post-processor alone, as an HF tokenizer.json may add it
        inner.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", inner.token_to_id("<s>"))]
        )
    (directory / "model").mkdir()
    inner.save(str(directory / "model" / "tokenizer.json"))
    (directory / "model" / "tokenizer_config.json").write_text(json.dumps(settings))
    if end_ids is not None:
        (directory / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": end_ids}))
    assert trained.vocab_size == 300
    return directory / "model" / "tokenizer.json"


def test_a_model_tokenizer_that_adds_bos_starts_every_document_with_it_in_every_data_path(tmp_path):
    """BOS and EOS as the model's tokenizer_config.json names them, whichever way the corpus is tokenized."""
    settings = {"add_bos_token": True, "bos_token": "<s>", "eos_token": {"content": "<|im_end|>"}}
    path = _model_tokenizer_files(tmp_path, settings)
    tokenizer = load_or_train_tokenizer(TokenizerConfig(path=str(path)), ListSource(DOCUMENTS), tmp_path / "cache")
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    assert (tokenizer.decode([bos]), tokenizer.eos_token) == ("<s>", "<|im_end|>")
    expected = [[bos, *tokenizer.encode(text), eos] for text in DOCUMENTS[:4]]
    assert tokenizer.document_ids(DOCUMENTS[:4]) == expected
    assert [tokenizer.document_text(ids) for ids in expected] == DOCUMENTS[:4]
    packed, lengths, _ = tokenize_documents(ListSource(DOCUMENTS[:4]), tokenizer, 0.0, seed=0)
    assert packed.tolist() == [token for ids in expected for token in ids]
    assert lengths.tolist() == [len(ids) for ids in expected]
    assert [tokens.tolist() for tokens, _ in shards._encode(tokenizer, DOCUMENTS[:4], 0.0, 0)] == expected
    # The cached copy (what the run directory and token shards keep) starts and ends documents alike.
    cached = Tokenizer.load(tmp_path / "cache" / "tokenizer.json")
    assert cached.document_ids(DOCUMENTS[:4]) == expected
    # An explicit data.tokenizer.eos_token still wins over the model's.
    explicit = load_or_train_tokenizer(
        TokenizerConfig(path=str(path), eos_token="<|endoftext|>"), ListSource(DOCUMENTS), tmp_path / "other"
    )
    assert explicit.document_ids(DOCUMENTS[:1])[0][-1] == explicit.encode("<|endoftext|>")[0] != eos


def test_bos_comes_from_the_post_processor_when_the_settings_do_not_say(tmp_path):
    path = _model_tokenizer_files(tmp_path, {}, bos_template=True)
    tokenizer = Tokenizer.load(path)
    assert tokenizer.decode([tokenizer.bos_id]) == "<s>" and tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.encode(DOCUMENTS[0])[0] != tokenizer.bos_id  # encode itself adds nothing
    assert Tokenizer.load(_model_tokenizer_files(tmp_path / "plain", {})).bos_id is None


def test_a_tokenizer_without_model_settings_packs_as_before(tmp_path):
    tokenizer = load_or_train_tokenizer(CONFIG, ListSource(DOCUMENTS), tmp_path)
    assert (tokenizer.bos_id, tokenizer.eos_token, tokenizer.stop_ids) == (None, "<|endoftext|>", (tokenizer.eos_id,))
    assert tokenizer.document_ids(DOCUMENTS[:1]) == [[*tokenizer.encode(DOCUMENTS[0]), tokenizer.eos_id]]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tokenizer.json"]  # nothing beside it


def test_end_of_turn_ids_travel_with_the_tokenizer(tmp_path):
    """generation_config.json's eos_token_id list: the ids a reply ends at, kept by save and load."""
    path = _model_tokenizer_files(tmp_path, {"eos_token": "<|endoftext|>"}, end_ids=[301])
    tokenizer = Tokenizer.load(path)
    assert tokenizer.stop_ids == (tokenizer.eos_id, 301) and tokenizer.decode([301]) == "<|im_end|>"
    (tmp_path / "copy").mkdir()
    tokenizer.save(tmp_path / "copy" / "tokenizer.json")
    assert Tokenizer.load(tmp_path / "copy" / "tokenizer.json").stop_ids == tokenizer.stop_ids


def test_the_chat_template_is_read_from_chat_template_jinja_where_transformers_5_saves_it(tmp_path):
    """A directory saved by transformers 5 keeps its template in chat_template.jinja, not in
    tokenizer_config.json; an older directory's tokenizer_config.json template wins when both are there."""
    path = _model_tokenizer_files(tmp_path, {"eos_token": "<|im_end|>"})
    (path.parent / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tokenizer = Tokenizer.load(path)
    assert tokenizer.chat_prompt([{"role": "user", "content": "hi"}]) == "[hi]"
    (tmp_path / "copy").mkdir()
    tokenizer.save(tmp_path / "copy" / "tokenizer.json")  # a run's copy: the template in its tokenizer_config.json
    assert Tokenizer.load(tmp_path / "copy" / "tokenizer.json").chat_prompt([{"role": "user", "content": "a"}]) == "[a]"
    settings = {"eos_token": "<|im_end|>", "chat_template": "{{ messages[0]['content'] }}!"}
    (path.parent / "tokenizer_config.json").write_text(json.dumps(settings))
    assert Tokenizer.load(path).chat_prompt([{"role": "user", "content": "hi"}]) == "hi!"
