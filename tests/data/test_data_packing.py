"""Packing: documents are split whole and deterministically, and the cache is reused, never stale."""

import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import MISSING

from axtorch.config.errors import ConfigError
from axtorch.data import DataConfig, PackedSequences, TextFilesSourceConfig, TokenizerConfig, build_data
from axtorch.data.held_out import is_held_out
from axtorch.data.packing import split_corpus

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega"]
DOCUMENTS = [
    f"doc {i}: " + " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(20 + i % 7)) + ".\n" for i in range(40)
]


def corpus_config(tmp_path: Path, **overrides) -> DataConfig:
    """A 40-file corpus; file names sort in document order."""
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        for index, text in enumerate(DOCUMENTS):
            (corpus / f"{index:03d}.txt").write_text(text, encoding="utf-8")
    settings = dict(
        source=TextFilesSourceConfig(paths=[str(corpus / "*.txt")]),
        tokenizer=TokenizerConfig(vocab_size=300),
        seq_len=16,
        val_fraction=0.2,
        seed=3,
        cache_dir=str(tmp_path / "cache"),
    )
    settings.update(overrides)
    return DataConfig(**settings)


def documents_of(tokens: np.ndarray, data) -> list[str]:
    """Decode a split's token stream back into its documents (each ends with EOS)."""
    ends = np.flatnonzero(tokens == data.tokenizer.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    assert ends[-1] == len(tokens) - 1
    return [data.tokenizer.decode(tokens[start:end].tolist()) for start, end in zip(starts, ends)]


def test_split_is_by_whole_document_in_order(tmp_path):
    config = corpus_config(tmp_path)
    data = build_data(config)
    is_validation = [is_held_out(text, config.val_fraction, config.seed) for text in DOCUMENTS]
    tokens_dir = data.tokenizer_path.parent
    train = np.load(tokens_dir / "train_tokens.npy")
    val = np.load(tokens_dir / "val_tokens.npy")
    assert train.dtype == val.dtype == np.uint16
    assert documents_of(val, data) == [d for d, v in zip(DOCUMENTS, is_validation) if v]
    assert documents_of(train, data) == [d for d, v in zip(DOCUMENTS, is_validation) if not v]
    assert data.train_num_sequences == (len(train) - 1) // config.seq_len
    assert data.val_num_sequences == (len(val) - 1) // config.seq_len > 0


def test_cache_is_reused_and_invalidated_by_changes(tmp_path):
    config = corpus_config(tmp_path)
    first = build_data(config)
    directory = first.tokenizer_path.parent
    assert sorted(p.name for p in directory.iterdir()) == [
        "meta.json",
        "tokenizer.json",
        "train_tokens.npy",
        "val_tokens.npy",
    ]
    mtimes = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    second = build_data(config)
    assert second.tokenizer_path == first.tokenizer_path
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == mtimes

    assert build_data(corpus_config(tmp_path, seed=4)).tokenizer_path.parent != directory
    (tmp_path / "corpus" / "000.txt").write_text("doc 0 was edited, and is longer now.\n")
    assert build_data(config).tokenizer_path.parent != directory


def test_sequences_overlap_by_one_token():
    tokens = np.arange(50, dtype=np.uint16)
    sequences = PackedSequences(tokens, seq_len=8, split="train")
    assert len(sequences) == (50 - 1) // 8
    windows = sequences.gather(np.array([0, 2, 5]))
    assert windows.dtype == np.int64 and windows.shape == (3, 9)
    assert windows[:, 0].tolist() == [0, 16, 40]
    assert windows[1].tolist() == list(range(16, 25))


def test_too_few_tokens_names_seq_len_and_split_size():
    with pytest.raises(ConfigError, match=r"validation split has only 8 tokens") as error:
        PackedSequences(np.arange(8, dtype=np.uint16), seq_len=8, split="validation")
    assert error.value.key == "data.seq_len"
    assert len(PackedSequences(np.arange(9, dtype=np.uint16), seq_len=8, split="validation")) == 1
    assert len(PackedSequences(np.arange(0, dtype=np.uint16), seq_len=8, split="validation")) == 0


def test_seq_len_longer_than_corpus_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as error:
        build_data(corpus_config(tmp_path, seq_len=100_000))
    assert error.value.key == "data.seq_len"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"val_fraction": 0.5}, "data.val_fraction"),
        ({"val_fraction": -0.01}, "data.val_fraction"),
        ({"seq_len": 0}, "data.seq_len"),
        ({"source": MISSING}, "data.source"),
        ({"tokenizer": TokenizerConfig(vocab_size=10)}, "data.tokenizer.vocab_size"),
    ],
)
def test_bad_data_config(tmp_path, overrides, key):
    with pytest.raises(ConfigError) as error:
        build_data(corpus_config(tmp_path, **overrides))
    assert error.value.key == key
    assert not (tmp_path / "cache").exists()


def test_a_one_document_corpus_holds_out_its_last_tokens(tmp_path):
    book = tmp_path / "book"
    book.mkdir()
    (book / "book.txt").write_text(" ".join(DOCUMENTS))
    config = corpus_config(tmp_path, source=TextFilesSourceConfig(paths=[str(book / "*.txt")]), val_fraction=0.1)
    data = build_data(config)
    directory = data.tokenizer_path.parent
    train, val = np.load(directory / "train_tokens.npy"), np.load(directory / "val_tokens.npy")
    total = len(train) + len(val)
    assert len(val) == round(0.1 * total) and data.val_num_sequences > 0
    stream = np.concatenate([train, val])  # the held-out part is the tail, nothing lost or repeated
    assert data.tokenizer.decode(stream[:-1].tolist()) == " ".join(DOCUMENTS)
    assert json.loads((directory / "meta.json").read_text())["split_by"] == "tokens"


def test_many_documents_are_still_split_whole(tmp_path):
    build_data(corpus_config(tmp_path))
    (meta,) = (tmp_path / "cache").glob("*/meta.json")
    assert json.loads(meta.read_text())["split_by"] == "documents"


def test_split_corpus_falls_back_to_tokens_only_when_documents_hold_out_far_from_the_fraction():
    tokens = np.arange(1000, dtype=np.uint16)
    few = np.array([990, 10])  # the documents can hold out 0, 10, 990 or 1000 tokens of 1000: all wrong
    for held_out in ([False, False], [False, True], [True, False], [True, True]):
        _, val, how = split_corpus(tokens, few, np.array(held_out), val_fraction=0.2)
        assert how == "tokens" and np.array_equal(val, np.arange(800, 1000))
    many = np.full(100, 10)
    _, val, how = split_corpus(tokens, many, np.arange(100) % 5 == 0, val_fraction=0.2)
    assert how == "documents" and np.array_equal(val, tokens.reshape(100, 10)[::5].ravel())
