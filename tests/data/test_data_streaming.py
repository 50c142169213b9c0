"""Streaming: sources read in parts from saved positions, packed per virtual stream, the same global
batches on any number of data-parallel ranks, and exact resumes across rank counts."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from axtorch.config.errors import ConfigError
from axtorch.data import (
    DataConfig,
    HFDatasetSourceConfig,
    JsonlSourceConfig,
    ParquetSourceConfig,
    StreamingDataModule,
    TokenizerConfig,
    build_data,
)
from axtorch.data.held_out import is_held_out
from axtorch.data.streaming import PackedStream

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
BATCH, SEQ_LEN = 8, 16


def documents(count: int, seed: int = 0, prefix: str = "") -> list[str]:
    rng = random.Random(seed)
    return [f"{prefix}{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 40))) for i in range(count)]


def write_jsonl(directory: Path, texts: list[str], files: int = 3) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(files):
        lines = [json.dumps({"text": text}) + "\n" for text in texts[index::files]]
        if index == 1:
            lines.insert(2, "\n")  # blank lines are not documents
        (directory / f"{index}.jsonl").write_text("".join(lines))
    return str(directory / "*.jsonl")


def streaming_config(tmp_path: Path, source, **overrides) -> DataConfig:
    settings = {
        "tokenizer": TokenizerConfig(vocab_size=300),
        "seq_len": SEQ_LEN,
        "cache_dir": str(tmp_path / "cache"),
        "streams": 4,
        **overrides,
    }
    return DataConfig(source=source, **settings)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stream")
    write_jsonl(root / "jsonl", documents(300))
    return root


@pytest.fixture(scope="module")
def data(corpus) -> StreamingDataModule:
    built = build_data(
        streaming_config(corpus, JsonlSourceConfig(paths=[str(corpus / "jsonl/*.jsonl")], streaming=True))
    )
    assert isinstance(built, StreamingDataModule)
    return built


def global_batches(data, ranks: int, steps: int, states=None) -> list[torch.Tensor]:
    """Each step's global batch, the rows of ``ranks`` ranks put together (optionally resumed from ``states``)."""
    iterators = [data.train_batches(BATCH, rank, ranks) for rank in range(ranks)]
    for iterator in iterators:
        if states is not None:
            iterator.load_state_dict(json.loads(json.dumps(states)))  # as a checkpoint stores it
    batches = []
    for _ in range(steps):
        parts = [next(iterator) for iterator in iterators]
        for part in parts:
            assert part["input_ids"].shape == (BATCH // ranks, SEQ_LEN)
            assert torch.equal(part["labels"][:, :-1], part["input_ids"][:, 1:])
        batches.append(torch.cat([part["input_ids"] for part in parts]))
    return batches


def saved_state(data, ranks: int, steps: int) -> dict:
    iterators = [data.train_batches(BATCH, rank, ranks) for rank in range(ranks)]
    for _ in range(steps):
        for iterator in iterators:
            next(iterator)
    return iterators[0].combine([iterator.state_dict() for iterator in iterators])


def read_parts(source, parts: int) -> list[list[str]]:
    return [[text for text, _ in source.read_part(part, parts, 0)] for part in range(parts)]


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 40])
def test_jsonl_parts_hold_every_document_once(corpus, parts):
    source = JsonlSourceConfig(paths=[str(corpus / "jsonl/*.jsonl")]).build()
    whole = list(source.iter_documents())
    assert len(whole) == 300
    assert [text for part in read_parts(source, parts) for text in part] == whole


def test_a_part_resumes_from_a_saved_position(corpus):
    source = JsonlSourceConfig(paths=[str(corpus / "jsonl/*.jsonl")]).build()
    read = list(source.read_part(1, 3, 0))
    for cut in (0, 1, 17, len(read) - 1):
        assert [text for text, _ in source.read_part(1, 3, read[cut][1])] == [text for text, _ in read[cut + 1 :]]


def test_parquet_parts_are_row_groups_round_robin(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    texts = documents(100)
    for index in range(2):
        pq.write_table(
            pa.table({"text": texts[index * 50 : (index + 1) * 50]}), tmp_path / f"{index}.parquet", row_group_size=7
        )
    source = ParquetSourceConfig(paths=[str(tmp_path / "*.parquet")]).build()
    assert list(source.iter_documents()) == texts
    parts = read_parts(source, 3)
    assert sorted(text for part in parts for text in part) == sorted(texts)
    assert parts[1][:7] == texts[7:14]  # row group 1 of file 0
    read = list(source.read_part(2, 3, 0))
    assert [text for text, _ in source.read_part(2, 3, read[9][1])] == [text for text, _ in read[10:]]
    with pytest.raises(ConfigError) as error:
        ParquetSourceConfig(paths=[str(tmp_path / "*.parquet")], text_field="body").build()
    assert error.value.key == "data.source.text_field"


def test_hf_streaming_dataset_parts_and_resume(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    texts = documents(40)
    pattern = write_jsonl(tmp_path / "hf", texts, files=4)
    whole = HFDatasetSourceConfig(path="json", data_files=[pattern], streaming=True).build()
    ordered = list(whole.iter_documents())
    assert sorted(ordered) == sorted(texts)
    for parts in (2, 3):  # 4 files: IterableDataset.shard for 2; every 3rd row for 3
        assert sorted(text for part in read_parts(whole, parts) for text in part) == sorted(texts)
    read = list(whole.read_part(1, 2, 0))
    assert [text for text, _ in whole.read_part(1, 2, read[4][1])] == [text for text, _ in read[5:]]


def test_a_stream_packs_its_documents_as_the_cache_does(data, corpus):
    """One stream, one part: the windows of the documents' tokens, each followed by EOS, overlapping by one."""
    source = JsonlSourceConfig(paths=[str(corpus / "jsonl/*.jsonl")]).build()
    stream = PackedStream(source, 0, 1, data.tokenizer, SEQ_LEN, val_fraction=0.0, seed=0)
    eos = data.tokenizer.eos_id
    tokens = [t for text in source.iter_documents() for t in [*data.tokenizer.encode(text), eos]]
    windows = stream.take(20)
    expected = np.array([tokens[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1] for i in range(20)])
    assert np.array_equal(windows, expected)


def test_global_batches_are_the_same_on_1_2_and_4_ranks(data):
    one = global_batches(data, 1, steps=12)  # past an epoch of some streams
    for ranks in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(one, global_batches(data, ranks, steps=12)))
    assert not torch.equal(one[0], one[1])


@pytest.mark.parametrize("resumed_on", [1, 2, 4])
def test_a_state_saved_on_2_ranks_resumes_exactly_on_any(data, resumed_on):
    uninterrupted = global_batches(data, 1, steps=9)
    state = saved_state(data, ranks=2, steps=5)
    assert set(state["positions"]) == {f"0/{stream}" for stream in range(4)}
    resumed = global_batches(data, resumed_on, steps=4, states=state)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted[5:], resumed))


def test_resume_seeks_without_tokenizing_the_prefix(data, monkeypatch):
    state = saved_state(data, ranks=1, steps=6)
    encoded: list[str] = []
    encode_batch = type(data.tokenizer).encode_batch
    monkeypatch.setattr(
        type(data.tokenizer), "encode_batch", lambda self, texts: encoded.extend(texts) or encode_batch(self, texts)
    )
    iterator = data.train_batches(BATCH, 0, 1)
    iterator.load_state_dict(state)
    next(iterator)
    consumed = {int(text.split()[0]) for text in encoded}
    assert min(consumed) > 0  # nothing from the start of any stream was read again


def test_held_out_documents_are_never_trained_on(corpus, tmp_path):
    source = JsonlSourceConfig(paths=[str(corpus / "jsonl/*.jsonl")], streaming=True)
    in_order = list(source.build().iter_documents())
    held = [text for text in in_order if is_held_out(text, 0.2, 0)]
    assert 30 < len(held) < 90
    data = build_data(streaming_config(tmp_path, source, val_fraction=0.2))
    tokenizer = data.tokenizer
    trained = tokenizer.decode(torch.cat(global_batches(data, 1, steps=6)).flatten().tolist())
    validation = torch.cat([batch["input_ids"] for batch in data.val_batches(BATCH, 2)]).flatten().tolist()
    assert len(validation) == 2 * BATCH * SEQ_LEN
    eos = tokenizer.eos_id
    packed = [t for text in held for t in [*tokenizer.encode(text), eos]]
    assert validation[: SEQ_LEN + 1] == packed[: SEQ_LEN + 1]  # the corpus's first held-out documents, packed
    assert not any(text in trained for text in held if len(text) > 60)
    assert any(text in trained for text in in_order if text not in held and len(text) > 60)


def test_stream_layout_must_fit_the_ranks_and_the_batch(data):
    with pytest.raises(ConfigError) as error:
        data.train_batches(BATCH, 0, 8)  # 4 streams cannot be shared by 8 ranks
    assert error.value.key == "data.streams" and "[8]" in str(error.value)
    with pytest.raises(ConfigError, match=r"divides trainer.batch_size=6: \[1, 2, 3, 6\]"):
        data.train_batches(6, 0, 1)


def test_by_default_each_row_of_the_batch_is_a_stream_which_fits_any_number_of_ranks(corpus, tmp_path):
    source = JsonlSourceConfig(paths=[str(corpus / "jsonl/*.jsonl")], streaming=True)
    data = build_data(streaming_config(tmp_path, source, streams=None))

    def batches(ranks: int) -> list[torch.Tensor]:
        iterators = [data.train_batches(6, rank, ranks) for rank in range(ranks)]
        assert sum(len(iterator.state_dict()["positions"]) for iterator in iterators) == 6  # a stream per row
        return [torch.cat([next(iterator)["input_ids"] for iterator in iterators]) for _ in range(3)]

    one_rank = batches(1)
    for ranks in (2, 3, 6):
        assert all(torch.equal(a, b) for a, b in zip(batches(ranks), one_rank)), ranks


def test_a_stream_without_training_documents_says_so(tmp_path):
    pattern = write_jsonl(tmp_path / "few", documents(2), files=1)
    data = build_data(streaming_config(tmp_path, JsonlSourceConfig(paths=[pattern], streaming=True), streams=8))
    with pytest.raises(ValueError, match=r"virtual stream .* has no training documents; lower data\.streams"):
        for _ in range(4):
            next(data.train_batches(BATCH, 0, 1))


def test_a_checkpoint_of_the_other_loader_is_refused_clearly(data):
    iterator = data.train_batches(BATCH, 0, 1)
    with pytest.raises(ValueError, match=r"data\.streams, mixture sources"):
        iterator.load_state_dict({"epoch": 0, "index": 3})


def test_source_and_mixture_are_alternatives(corpus, tmp_path):
    from axtorch.data import MixtureEntryConfig

    source = JsonlSourceConfig(paths=[str(corpus / "jsonl/*.jsonl")], streaming=True)
    config = streaming_config(tmp_path, source, mixture=[MixtureEntryConfig(source=source, weight=1.0)])
    with pytest.raises(ConfigError) as error:
        build_data(config)
    assert error.value.key == "data.mixture" and "not both" in str(error.value)
    with pytest.raises(ConfigError) as error:
        build_data(streaming_config(tmp_path, None))
    assert error.value.key == "data.source"
    with pytest.raises(ConfigError) as error:
        build_data(streaming_config(tmp_path, source, streams=0))
    assert error.value.key == "data.streams"
