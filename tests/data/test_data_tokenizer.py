"""Tokenizer: byte-level BPE training is deterministic, cached, and round-trips any text."""

import hashlib
from collections.abc import Iterator

import pytest

from axtorch.config.errors import ConfigError
from axtorch.data import DocumentSource, Tokenizer, TokenizerConfig, load_or_train_tokenizer

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
