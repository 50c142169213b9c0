"""Training from a streamed corpus: a resumed run continues exactly, and two data-parallel processes
under torchrun, each reading only its own virtual streams, train as one process does."""

import json
import sysconfig
from pathlib import Path

import pytest
from forked_ranks import run_ranks

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.train.metrics import read_metrics
from axtorch.train.trainer import Trainer

pytestmark = pytest.mark.journey

STEPS = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """About 100 standard-library files as JSON lines."""
    path = tmp_path_factory.mktemp("streamed") / "docs.jsonl"
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:100]
    path.write_text("".join(json.dumps({"text": file.read_text(errors="replace")}) + "\n" for file in files))
    return path


def overrides(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "data=jsonl",
        f"data.source.paths=[{corpus}]",
        "data.source.streaming=true",
        "model=llama_debug",
        "data.seq_len=64",
        "data.tokenizer.vocab_size=512",
        "data.val_fraction=0.05",
        f"data.cache_dir={corpus.parent / 'cache'}",
        f"run_dir={run_dir}",
        f"trainer.max_steps={STEPS}",
        "trainer.batch_size=8",
        "trainer.log_every=1",
        "trainer.eval_every=3",
        "trainer.eval_batches=2",
        "trainer.checkpoint_every=3",
        "trainer.progress_bar=false",
        "trainer.plot=false",
        *extra,
    ]


def metric(run_dir: Path, name: str) -> list[float]:
    return [m[name] for m in read_metrics(run_dir / "metrics.jsonl") if name in m]


def test_a_resumed_streaming_run_matches_an_uninterrupted_one(corpus, tmp_path):
    whole = Trainer(load_experiment_config(overrides(corpus, tmp_path / "whole"))).fit()
    Trainer(load_experiment_config(overrides(corpus, tmp_path / "parts"))).fit(until_step=3)
    resumed = Trainer(load_experiment_config(overrides(corpus, tmp_path / "parts"))).fit()
    assert resumed.step == whole.step == STEPS
    assert metric(tmp_path / "parts", "train/loss") == metric(tmp_path / "whole", "train/loss")
    assert resumed.final_eval_loss == whole.final_eval_loss


def _train_two_ranks(corpus: Path, run_dir: Path, *extra: str) -> None:
    run_ranks(
        2, "-m", "axtorch.train", *overrides(corpus, run_dir, "backend=native", "mesh.fsdp=2", "sharding=fsdp", *extra)
    )


@pytest.mark.slow
def test_two_processes_train_a_streamed_corpus_as_one_does(corpus, tmp_path):
    Trainer(load_experiment_config(overrides(corpus, tmp_path / "one"))).fit()
    _train_two_ranks(corpus, tmp_path / "two")
    assert metric(tmp_path / "two", "train/loss") == pytest.approx(metric(tmp_path / "one", "train/loss"), rel=1e-4)
    assert metric(tmp_path / "two", "eval/loss") == pytest.approx(metric(tmp_path / "one", "eval/loss"), rel=1e-4)
    # The two processes' checkpoint resumes on one process: the data position of every virtual stream is in it.
    state = json.loads((tmp_path / "two/checkpoints/step_00000003/trainer_state.json").read_text())["data"]
    assert len(state["positions"]) == 8
    (tmp_path / "two/checkpoints/step_00000006").rename(tmp_path / "two/later")
    Trainer(load_experiment_config(overrides(corpus, tmp_path / "two"))).fit()
    resumed = read_metrics(tmp_path / "two/metrics.jsonl")
    losses = [m["train/loss"] for m in resumed if "train/loss" in m and m["step"] > 3][-3:]
    assert losses == pytest.approx(metric(tmp_path / "one", "train/loss")[3:], rel=1e-4)
