"""One held-out rule: text files tokenized up front, their ``axtorch-tokenize`` shards and the same
texts streamed from JSONL (in another order) hold out the same documents for the same seed."""

import json
from pathlib import Path

import numpy as np

from axtorch.cli.tokenize import main as tokenize_main
from axtorch.data import DataConfig, JsonlSourceConfig, TextFilesSourceConfig, TokenizerConfig, build_data
from axtorch.data.held_out import document_score, is_held_out, needs_token_split, token_split_size
from axtorch.data.shards import MANIFEST_FILE, read_shards
from axtorch.data.streaming import PackedStream

WORDS = ["north", "south", "east", "west", "river", "stone", "field", "cloud", "ember", "frost", "amber"]
DOCUMENTS = [
    f"note {i}: " + " ".join(WORDS[(i * 7 + j * 5) % len(WORDS)] for j in range(8 + i % 13)) for i in range(60)
]
SEED, FRACTION = 5, 0.2


def write_corpus(root: Path, texts: list[str]) -> Path:
    """``texts`` as text files named in their order, and as the lines of two JSONL files in another order."""
    (root / "files").mkdir(parents=True)
    for index, text in enumerate(texts):
        (root / "files" / f"{index:03d}.txt").write_text(text, encoding="utf-8")
    (root / "jsonl").mkdir()
    reverse = texts[::-1]
    for part in range(2):
        lines = "".join(json.dumps({"text": text}) + "\n" for text in reverse[part::2])
        (root / "jsonl" / f"{part}.jsonl").write_text(lines, encoding="utf-8")
    return root


def split_documents(stream: np.ndarray, eos: int) -> list[np.ndarray]:
    """A split's token stream as its documents (each ends with EOS)."""
    ends = np.flatnonzero(stream == eos) + 1
    assert ends.size == 0 or ends[-1] == stream.size
    return np.split(stream, ends[:-1]) if ends.size else []


def up_front(root: Path, seed: int, fraction: float):
    """(data module, train tokens, val tokens, how it split) of ``data=text_files``."""
    config = DataConfig(
        source=TextFilesSourceConfig(paths=[str(root / "files" / "*.txt")]),
        tokenizer=TokenizerConfig(vocab_size=300),
        seq_len=4,
        val_fraction=fraction,
        seed=seed,
        cache_dir=str(root / "cache"),
    )
    data = build_data(config)
    directory = data.tokenizer_path.parent
    meta = json.loads((directory / "meta.json").read_text())
    train, val = (np.load(directory / f"{split}_tokens.npy") for split in ("train", "val"))
    return data, train, val, meta["split_by"]


def tokenized(root: Path, tokenizer_path: Path, seed: int, fraction: float):
    """(train tokens, val tokens, how it split) of the shards ``axtorch-tokenize`` writes of the same files."""
    out = root / f"shards-{seed}-{fraction}"
    args = [
        "data=text_files",
        f"data.source.paths=[{root}/files/*.txt]",
        f"data.tokenizer.path={tokenizer_path}",
        f"data.val_fraction={fraction}",
        f"data.seed={seed}",
        f"out={out}",
        "workers=1",
        "shard_tokens=64",
    ]
    assert tokenize_main(args) == 0
    _, splits = read_shards(out)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    for split, shards in manifest["splits"].items():  # the lengths files still cut the stream into its pieces
        lengths = sum(int(np.fromfile(out / shard["lengths"], dtype="<u4").sum()) for shard in shards)
        assert lengths == splits[split].size
    train, val = (splits[split][np.arange(splits[split].size)] for split in ("train", "val"))
    return train, val, manifest["split_by"]


def streamed_held_out(root: Path, tokenizer, seed: int, fraction: float) -> np.ndarray:
    """The held-out token stream the streaming reader packs from the JSONL copy (windows of 2 lose no token)."""
    source = JsonlSourceConfig(paths=[str(root / "jsonl" / "*.jsonl")], streaming=True).build()
    stream = PackedStream(source, 0, 1, tokenizer, seq_len=1, val_fraction=fraction, seed=seed, held_out=True)
    windows = stream.take(100_000)
    return np.concatenate([windows[:, 0], windows[-1:, 1]])


def test_the_rule_is_a_seeded_hash_of_the_text():
    scores = [document_score(text, SEED) for text in DOCUMENTS]
    assert scores == [document_score(text, SEED) for text in DOCUMENTS]  # the same on every run
    assert scores != [document_score(text, SEED + 1) for text in DOCUMENTS]
    assert all(0 <= score < 1 for score in scores)
    held = [is_held_out(text, FRACTION, SEED) for text in DOCUMENTS]
    assert held == [score < FRACTION for score in scores] and 4 < sum(held) < 24
    assert not any(is_held_out(text, 0.0, SEED) for text in DOCUMENTS)
    assert is_held_out("the same text", 0.3, 1) == is_held_out("the same text", 0.3, 1)  # duplicates: one side


def test_the_token_split_is_taken_when_documents_hold_out_under_a_quarter_or_over_twice_the_fraction():
    assert [needs_token_split(held, 1000, 0.1) for held in (0, 24, 25, 100, 200, 201, 1000)] == [
        True,
        True,
        False,
        False,
        False,
        True,
        True,
    ]
    assert not needs_token_split(0, 1000, 0.0)  # nothing to hold out, nothing held out
    assert token_split_size(1001, 0.1) == 100


def test_every_source_holds_out_the_same_documents(tmp_path):
    root = write_corpus(tmp_path, DOCUMENTS)
    data, train, val, how = up_front(root, SEED, FRACTION)
    eos, decode = data.tokenizer.eos_id, data.tokenizer.decode
    expected = [text for text in DOCUMENTS if is_held_out(text, FRACTION, SEED)]
    assert how == "documents" and 4 < len(expected) < 24
    assert [decode(doc[:-1].tolist()) for doc in split_documents(val, eos)] == expected

    shard_train, shard_val, shard_how = tokenized(root, data.tokenizer_path, SEED, FRACTION)
    assert shard_how == "documents"
    np.testing.assert_array_equal(shard_val, val)
    np.testing.assert_array_equal(shard_train, train)

    streamed = [
        decode(doc[:-1].tolist())
        for doc in split_documents(streamed_held_out(root, data.tokenizer, SEED, FRACTION), eos)
    ]
    assert sorted(streamed) == sorted(expected)  # the JSONL copy lists them in another order


def test_a_corpus_split_by_tokens_is_split_alike_up_front_and_in_shards(tmp_path):
    texts = [" ".join(f"{WORDS[(i + j) % len(WORDS)]}{j % 17}" for j in range(150)) for i in range(4)]
    # A seed that holds out the second of four similar documents: a quarter of the tokens, over twice 0.1.
    seed = next(s for s in range(500) if [is_held_out(text, 0.1, s) for text in texts] == [False, True, False, False])
    root = write_corpus(tmp_path, texts)
    data, train, val, how = up_front(root, seed, 0.1)
    whole = np.concatenate([np.array([*data.tokenizer.encode(text), data.tokenizer.eos_id]) for text in texts])
    assert how == "tokens" and val.size == token_split_size(whole.size, 0.1)
    np.testing.assert_array_equal(np.concatenate([train, val]), whole)  # in corpus order: the held-out document is back
    shard_train, shard_val, shard_how = tokenized(root, data.tokenizer_path, seed, 0.1)
    assert shard_how == "tokens"
    np.testing.assert_array_equal(shard_train, train)
    np.testing.assert_array_equal(shard_val, val)
    assert (
        sorted(path.name for path in (root / f"shards-{seed}-0.1").glob(".*")) == []
    )  # the by-document shards are gone


def test_no_held_out_fraction_holds_out_nothing_anywhere(tmp_path):
    root = write_corpus(tmp_path, DOCUMENTS[:10])
    data, train, val, how = up_front(root, SEED, 0.0)
    assert val.size == 0 and how == "documents"
    shard_train, shard_val, _ = tokenized(root, data.tokenizer_path, SEED, 0.0)
    assert shard_val.size == 0
    np.testing.assert_array_equal(shard_train, train)
