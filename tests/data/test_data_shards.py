"""axtorch-tokenize: a corpus tokenized once, streaming, into shards that training memory-maps."""

import json
import shutil

import numpy as np
import pytest

from axtorch.cli.tokenize import main as tokenize_main
from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.data.held_out import is_held_out
from axtorch.data.shards import MANIFEST_FILE, ShardedTokens, TokenizedSourceConfig, read_shards
from axtorch.data.tokenizer import Tokenizer
from axtorch.train.trainer import Trainer

DOCUMENTS = [f"document {i}: " + " ".join(f"word{(i * 7 + j) % 53}" for j in range(40 + i % 30)) for i in range(120)]
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    corpus = root / "corpus"
    corpus.mkdir()
    for i, text in enumerate(DOCUMENTS):
        (corpus / f"{i:04d}.txt").write_text(text)
    out = root / "tokens"
    args = [
        "data=text_files",
        f"data.source.paths=[{corpus}/*.txt]",
        "data.tokenizer.vocab_size=300",
        "data.val_fraction=0.2",
        f"out={out}",
        "workers=2",
        "shard_tokens=2000",
    ]
    assert tokenize_main(args) == 0
    return out


def test_the_shards_hold_each_document_and_eos_in_order_split_by_a_seeded_hash(tokenized):
    manifest = json.loads((tokenized / MANIFEST_FILE).read_text())
    assert manifest["documents"] == len(DOCUMENTS) and manifest["dtype"] == "<u2"
    assert len(manifest["splits"]["train"]) > 3  # 2000-token shards
    tokenizer = Tokenizer.load(tokenized / "tokenizer.json", EOS)
    expected = {"train": [], "val": []}
    for text in DOCUMENTS:  # in the order of their files' names
        split = "val" if is_held_out(text, 0.2, 0) else "train"
        expected[split].append([*tokenizer.encode(text), tokenizer.eos_id])
    assert 10 < len(expected["val"]) < 40
    _, splits = read_shards(tokenized)
    for split, documents in expected.items():
        stream = splits[split]
        flat = np.concatenate([np.array(d) for d in documents])
        assert stream.size == flat.size
        np.testing.assert_array_equal(stream[np.arange(stream.size)], flat)
        lengths = np.concatenate(
            [np.fromfile(tokenized / shard["lengths"], dtype="<u4") for shard in manifest["splits"][split]]
        )
        np.testing.assert_array_equal(lengths, [len(d) for d in documents])


def test_windows_across_shard_boundaries_read_like_one_array():
    parts = [np.arange(0, 5), np.arange(5, 5), np.arange(5, 17), np.arange(17, 20)]
    stream = ShardedTokens.__new__(ShardedTokens)
    stream.dtype = np.dtype(np.int64)
    stream.parts = [p for p in parts if p.size]
    stream.starts = np.cumsum([0] + [p.size for p in stream.parts])
    positions = np.array([[3, 4, 5, 6], [15, 16, 17, 19]])
    np.testing.assert_array_equal(stream[positions], positions)


def test_training_reads_the_shards(tokenized, tmp_path):
    config = load_experiment_config(
        [
            "model=llama_debug",
            "data=tokenized",
            f"data.source.path={tokenized}",
            "data.seq_len=32",
            f"run_dir={tmp_path / 'run'}",
            "trainer.max_steps=3",
            "trainer.batch_size=4",
            "trainer.eval_batches=2",
            "trainer.progress_bar=false",
            "trainer.plot=false",
        ]
    )
    trainer = Trainer(config)
    assert isinstance(trainer.data._train.tokens, ShardedTokens)
    assert trainer.data.tokenizer_path == tokenized / "tokenizer.json"
    result = trainer.fit()
    assert result.step == 3 and np.isfinite(result.final_eval_loss)


def test_a_changed_tokenizer_or_a_short_shard_is_refused(tokenized, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tokenized, copy)
    with open(copy / "train-00001.tokens", "ab") as handle:
        handle.write(b"\x00\x00")
    with pytest.raises(ConfigError, match=r"train-00001\.tokens"):
        read_shards(copy)
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text().replace(EOS, "<|end|>"))
    with pytest.raises(ConfigError, match=r"tokenizer\.json changed"):
        read_shards(copy)
    with pytest.raises(ConfigError, match=r"no manifest\.json"):
        read_shards(tmp_path)


def test_the_command_refuses_a_directory_with_files(tokenized, capsys):
    assert tokenize_main([f"out={tokenized}"]) == 2
    assert "a new or empty directory" in capsys.readouterr().err


def test_a_tokenized_directory_reads_back_as_its_documents(tokenized):
    """Built as a source, a tokenized directory yields its documents again (to tokenize anew)."""
    source = TokenizedSourceConfig(path=str(tokenized)).build()
    assert sorted(source.iter_documents()) == sorted(DOCUMENTS)
    assert source.fingerprint() == TokenizedSourceConfig(path=str(tokenized)).build().fingerprint()


def test_too_few_documents_hold_out_the_last_tokens_instead(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "book.txt").write_text(" ".join(f"word{i % 97}" for i in range(6000)))  # one document
    out = tmp_path / "tokens"
    args = ["data=text_files", f"data.source.paths=[{corpus}/*.txt]", "data.tokenizer.vocab_size=300"]
    assert tokenize_main([*args, "data.val_fraction=0.1", f"out={out}", "workers=1", "shard_tokens=500"]) == 0
    tokenizer, splits = read_shards(out)
    whole = np.array([*tokenizer.encode((corpus / "book.txt").read_text()), tokenizer.eos_id])
    train, val = (splits[s][np.arange(splits[s].size)] for s in ("train", "val"))
    assert val.size == round(0.1 * whole.size)
    np.testing.assert_array_equal(np.concatenate([train, val]), whole)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    for split in ("train", "val"):
        lengths = [np.fromfile(out / shard["lengths"], dtype="<u4") for shard in manifest["splits"][split]]
        assert sum(int(part.sum()) for part in lengths) == splits[split].size
