"""Weighted mixtures: each row's source is drawn from (seed, step, row), so the realised shares follow
the weights, and the batches are the same on any number of ranks and after a resume."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from axtorch.compose.experiment_loader import ExperimentConfig, load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.config.serialize import config_from_dict, config_to_dict
from axtorch.data import DataConfig, JsonlSourceConfig, MixtureEntryConfig, TextFilesSourceConfig, TokenizerConfig
from axtorch.data import build_data as build
from axtorch.data.mixture import row_sources

BATCH, SEQ_LEN = 8, 16


def write_corpus(directory: Path, letters: str, count: int = 200) -> str:
    """JSONL documents whose words use only ``letters``: a row's letters tell which corpus it came from."""
    rng = random.Random(letters)
    directory.mkdir(parents=True)
    lines = [
        json.dumps({"text": " ".join("".join(rng.choices(letters, k=3)) for _ in range(rng.randint(1, 30)))})
        for _ in range(count)
    ]
    (directory / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return str(directory / "*.jsonl")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[Path, str, str]:
    root = tmp_path_factory.mktemp("mixture")
    return root, write_corpus(root / "first", "abcdef"), write_corpus(root / "second", "uvwxyz")


def mixture_config(corpora, weights=(0.7, 0.3), seed=0) -> DataConfig:
    root, first, second = corpora
    entries = [
        MixtureEntryConfig(source=JsonlSourceConfig(paths=[pattern]), weight=weight)
        for pattern, weight in zip((first, second), weights)
    ]
    return DataConfig(
        mixture=entries,
        tokenizer=TokenizerConfig(vocab_size=300),
        seq_len=SEQ_LEN,
        seed=seed,
        cache_dir=str(root / "cache"),
        streams=4,
    )


def global_batches(data, ranks: int, steps: int, state=None) -> list[torch.Tensor]:
    iterators = [data.train_batches(BATCH, rank, ranks) for rank in range(ranks)]
    for iterator in iterators:
        if state is not None:
            iterator.load_state_dict(json.loads(json.dumps(state)))
    return [torch.cat([next(iterator)["input_ids"] for iterator in iterators]) for _ in range(steps)]


def test_row_sources_follow_the_weights_and_the_seed():
    draws = torch.from_numpy(np.array([row_sources(3, step, 64, [0.7, 0.2, 0.1]) for step in range(200)]))
    shares = torch.bincount(draws.flatten(), minlength=3) / draws.numel()
    assert torch.allclose(shares, torch.tensor([0.7, 0.2, 0.1]), atol=0.02)
    assert (row_sources(3, 5, 64, [0.5, 0.5]) == row_sources(3, 5, 64, [0.5, 0.5])).all()
    assert not (row_sources(3, 5, 64, [0.5, 0.5]) == row_sources(4, 5, 64, [0.5, 0.5])).all()


def test_realised_token_shares_approach_the_weights(corpora):
    data = build(mixture_config(corpora, weights=(3.0, 1.0)))  # relative weights: 0.75 / 0.25
    rows = torch.cat(global_batches(data, 1, steps=60))
    first = sum(set(data.tokenizer.decode(row.tolist())) <= set("abcdef <|endoftx>") for row in rows)
    second = sum(set(data.tokenizer.decode(row.tolist())) <= set("uvwxyz <|endoftx>") for row in rows)
    assert first + second == len(rows)  # every row is one source's
    assert abs(first / len(rows) - 0.75) < 0.05


def test_the_same_seed_gives_the_same_batches_on_any_number_of_ranks(corpora):
    data = build(mixture_config(corpora))
    one = global_batches(data, 1, steps=10)
    for ranks in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(one, global_batches(data, ranks, steps=10)))
    other_seed = global_batches(build(mixture_config(corpora, seed=1)), 1, steps=10)
    assert not all(torch.equal(a, b) for a, b in zip(one, other_seed))


@pytest.mark.parametrize("resumed_on", [1, 4])
def test_a_mixture_resumes_exactly_on_other_rank_counts(corpora, resumed_on):
    data = build(mixture_config(corpora))
    uninterrupted = global_batches(data, 1, steps=8)
    iterators = [data.train_batches(BATCH, rank, 2) for rank in range(2)]
    for _ in range(5):
        for iterator in iterators:
            next(iterator)
    state = iterators[0].combine([iterator.state_dict() for iterator in iterators])
    assert set(state["positions"]) == {f"{source}/{stream}" for source in range(2) for stream in range(4)}
    resumed = global_batches(data, resumed_on, steps=3, state=state)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted[5:], resumed))


def test_validation_takes_each_source_by_its_weight(corpora):
    config = mixture_config(corpora)
    config.val_fraction = 0.2
    rows = torch.cat([batch["input_ids"] for batch in build(config).val_batches(BATCH, 2)])
    assert len(rows) == 2 * BATCH


def test_bad_mixtures_name_their_key(corpora):
    config = mixture_config(corpora, weights=(1.0, 0.0))
    with pytest.raises(ConfigError) as error:
        build(config)
    assert error.value.key == "data.mixture[1].weight"
    config.mixture = []
    with pytest.raises(ConfigError) as error:
        build(config)
    assert error.value.key == "data.mixture"
    config.mixture = [MixtureEntryConfig(source=TextFilesSourceConfig(paths=[corpora[1]]))]
    with pytest.raises(ConfigError, match="a source that can stream") as error:
        build(config)
    assert error.value.key == "data.mixture[0].source"


def test_the_command_line_names_each_entry_s_source_kind(corpora):
    _, first, second = corpora
    entries = [
        f"{{source: {{kind: jsonl, paths: ['{path}']}}, weight: {weight}}}"
        for path, weight in [(first, 0.7), (second, 0.3)]
    ]
    mixture = f"[{', '.join(entries)}]"
    config = load_experiment_config(["data=mixture", f"data.mixture={mixture}"])
    assert config.data.source is None
    assert [entry.weight for entry in config.data.mixture] == [0.7, 0.3]
    assert config.data.mixture[1].source == JsonlSourceConfig(paths=[second])
    # A run directory's config.yaml names each source's class, so it rebuilds the same mixture.
    assert config_from_dict(config_to_dict(config), ExperimentConfig).data.mixture == config.data.mixture
    with pytest.raises(ConfigError) as error:
        load_experiment_config(["data=mixture", "data.mixture=[{source: {kind: csv, paths: [x]}}]"])
    assert error.value.key == "data.mixture[0].source.kind" and "jsonl" in error.value.allowed
    with pytest.raises(ConfigError) as error:
        load_experiment_config(["data=mixture", "data.mixture=[{source: {kind: jsonl, path: [x]}}]"])
    assert error.value.key == "data.mixture[0].source"
