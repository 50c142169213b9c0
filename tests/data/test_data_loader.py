"""Loader: the training order is a pure function of (seed, epoch, batch), so resuming is exact."""

import json

import numpy as np
import pytest
import torch

from axtorch.data import (
    BatchIterator,
    DataConfig,
    PackedSequences,
    TextFilesSourceConfig,
    TokenizerConfig,
    build_data,
)
from axtorch.data.loader import iter_validation_batches

SEQ_LEN = 4


def sequences(count: int) -> PackedSequences:
    """``count`` windows over 0, 1, 2, ...: window i starts at token i * SEQ_LEN."""
    return PackedSequences(np.arange(count * SEQ_LEN + 1, dtype=np.uint16), SEQ_LEN, "train")


def window_indices(batch: dict) -> list[int]:
    return (batch["input_ids"][:, 0] // SEQ_LEN).tolist()


def assert_same(first: dict, second: dict) -> None:
    assert first.keys() == second.keys() == {"input_ids", "labels"}
    for key in first:
        assert torch.equal(first[key], second[key])


def test_batches_follow_the_seeded_permutation():
    iterator = BatchIterator(sequences(10), batch_size=3, seed=7)
    batch = next(iterator)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert batch["input_ids"].shape == batch["labels"].shape == (3, SEQ_LEN)
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    assert torch.equal(batch["labels"][:, -1], batch["input_ids"][:, -1] + 1)
    generator = torch.Generator().manual_seed(7 * 1_000_003 + 0)
    assert window_indices(batch) == torch.randperm(10, generator=generator)[:3].tolist()


def test_epochs_drop_the_ragged_tail_and_reshuffle():
    iterator = BatchIterator(sequences(10), batch_size=3, seed=0)
    epoch0 = [window_indices(next(iterator)) for _ in range(3)]
    assert iterator.epoch == 1
    seen = [index for window in epoch0 for index in window]
    assert len(set(seen)) == 9
    epoch1 = [window_indices(next(iterator)) for _ in range(3)]
    assert epoch1 != epoch0
    assert len({index for window in epoch1 for index in window}) == 9


def test_same_seed_same_batches_other_seed_other_batches():
    first, second = BatchIterator(sequences(20), 4, seed=1), BatchIterator(sequences(20), 4, seed=1)
    for _ in range(12):
        assert_same(next(first), next(second))
    other = BatchIterator(sequences(20), 4, seed=2)
    fresh = BatchIterator(sequences(20), 4, seed=1)
    assert [window_indices(next(other)) for _ in range(5)] != [window_indices(next(fresh)) for _ in range(5)]


@pytest.mark.parametrize("taken", [2, 3, 4, 5])
def test_resume_is_bit_identical(taken):
    # 3 batches per epoch, so these positions sit before, on and after an epoch boundary.
    uninterrupted = BatchIterator(sequences(10), batch_size=3, seed=5)
    expected = [next(uninterrupted) for _ in range(taken + 4)]

    interrupted = BatchIterator(sequences(10), batch_size=3, seed=5)
    for _ in range(taken):
        next(interrupted)
    state = json.loads(json.dumps(interrupted.state_dict()))
    assert state == {"epoch": taken // 3, "index": taken % 3}

    resumed = BatchIterator(sequences(10), batch_size=3, seed=5)
    resumed.load_state_dict(state)
    assert resumed.epoch == state["epoch"]
    for position in range(taken, taken + 4):
        assert_same(next(resumed), expected[position])


def test_bad_state_and_batch_size_are_rejected():
    iterator = BatchIterator(sequences(10), batch_size=3, seed=0)
    with pytest.raises(ValueError, match="out of range"):
        iterator.load_state_dict({"epoch": 0, "index": 3})
    with pytest.raises(ValueError, match="exceeds the 10 training sequences"):
        BatchIterator(sequences(10), batch_size=11, seed=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        BatchIterator(sequences(10), batch_size=0, seed=0)


def test_validation_batches_are_in_order():
    batches = list(iter_validation_batches(sequences(10), batch_size=4))
    assert [window_indices(b) for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [window_indices(b) for b in iter_validation_batches(sequences(3), batch_size=4)] == [[0, 1, 2]]
    assert len(list(iter_validation_batches(sequences(10), batch_size=2, max_batches=3))) == 3
    empty = PackedSequences(np.zeros(0, dtype=np.uint16), SEQ_LEN, "validation")
    assert list(iter_validation_batches(empty, batch_size=4)) == []


def test_data_module_end_to_end(tmp_path):
    for index in range(12):
        (tmp_path / f"{index:02d}.txt").write_text(f"file {index}: " + "lorem ipsum dolor sit amet " * 8)
    config = DataConfig(
        source=TextFilesSourceConfig(paths=[str(tmp_path / "*.txt")]),
        tokenizer=TokenizerConfig(vocab_size=300),
        seq_len=8,
        val_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
    )
    data = build_data(config)
    assert data.tokenizer_path.is_file()
    batch = next(data.train_batches(4))
    assert batch["input_ids"].shape == (4, 8) and batch["input_ids"].dtype == torch.long
    assert int(batch["input_ids"].max()) < data.tokenizer.vocab_size
    val = list(data.val_batches(2))
    assert len(val) == data.val_num_sequences // 2 > 0
    assert_same(val[0], next(iter(build_data(config).val_batches(2))))
