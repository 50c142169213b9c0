"""Checkpoints are either verifiably whole or refused: manifests, fallback on resume, retention, failed saves."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import xxhash
from quiet_runs import quiet_debug_run

from axtorch.cli.ckpt import main as ckpt_main
from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.train import checkpoint as checkpoint_module
from axtorch.train.checkpoint import checkpoint_problems, list_checkpoints, read_index, read_model_tensors
from axtorch.train.checkpoint_manifest import MANIFEST_FILE, CheckpointError
from axtorch.train.trainer import Trainer


def _overrides(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return quiet_debug_run(
        run_dir,
        cache,
        "trainer.max_steps=15",
        "trainer.checkpoint_every=5",
        "trainer.eval_every=100",
        "trainer.log_every=5",
        *extra,
    )


def _fit(run_dir: Path, cache: Path, *extra: str):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Trainer(load_experiment_config(_overrides(run_dir, cache, *extra))).fit()
    return result, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    _fit(root / "straight", root / "cache")
    return root / "straight"


def test_the_manifest_lists_every_file_with_its_size_and_digest(straight_run):
    checkpoint = list_checkpoints(straight_run / "checkpoints")[-1]
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())["files"]
    on_disk = {p.name for p in checkpoint.iterdir()} - {MANIFEST_FILE}
    assert set(manifest) == on_disk
    for name, record in manifest.items():
        data = (checkpoint / name).read_bytes()
        assert record == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    assert checkpoint_problems(checkpoint) == []


def _flip_bytes_near_the_end(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 64, len(data) - 32):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def _garble_index(path: Path) -> None:
    index = json.loads(path.read_text())
    index["tensors"]["embedding.weight"]["shape"] = [1, 1]
    path.write_text(json.dumps(index))


def _escape(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    manifest["files"]["../../outside.txt"] = {"size": 1, "xxh3_128": "0" * 32}
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))


CORRUPTIONS = {
    "flipped bytes": (lambda c: _flip_bytes_near_the_end(c / "model.safetensors"), "model.safetensors does not match"),
    "truncation": (lambda c: _truncate(c / "optimizer.safetensors", 100), "optimizer.safetensors has 100 bytes"),
    "deleted shard": (lambda c: (c / "model.safetensors").unlink(), "model.safetensors is missing"),
    "missing manifest": (lambda c: (c / MANIFEST_FILE).unlink(), f"no {MANIFEST_FILE}"),
    "garbled manifest": (lambda c: (c / MANIFEST_FILE).write_text("{not json"), f"{MANIFEST_FILE} is unreadable"),
    "wrong size": (
        lambda c: (c / "trainer_state.json").write_text((c / "trainer_state.json").read_text() + " "),
        "trainer_state.json has",
    ),
    "garbled index": (lambda c: _garble_index(c / "model.safetensors.index.json"), "model.safetensors.index.json has"),
    "path outside the checkpoint": (_escape, "outside the checkpoint directory"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_each_kind_of_damage_is_detected_and_named(straight_run, tmp_path, case):
    damage, expected = CORRUPTIONS[case]
    checkpoint = tmp_path / "step_00000015"
    shutil.copytree(list_checkpoints(straight_run / "checkpoints")[-1], checkpoint)
    damage(checkpoint)
    problems = checkpoint_problems(checkpoint)
    assert any(expected in problem for problem in problems), problems
    assert ckpt_main(["verify", str(checkpoint)]) == 1


def test_an_index_pointing_outside_the_checkpoint_is_refused_before_any_file_is_opened(straight_run, tmp_path):
    checkpoint = tmp_path / "step_00000015"
    shutil.copytree(list_checkpoints(straight_run / "checkpoints")[-1], checkpoint)
    index_path = checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["tensors"]["embedding.weight"]["pieces"][0]["file"] = "../../../etc/passwd"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        read_index(checkpoint)


def test_a_damaged_newest_checkpoint_is_skipped_and_its_steps_redone_exactly(straight_run, tmp_path):
    cache = straight_run.parent / "cache"
    run = tmp_path / "run"
    _fit(run, cache)
    _flip_bytes_near_the_end(run / "checkpoints" / "step_00000015" / "model.safetensors")
    result, messages = _fit(run, cache)
    assert result.step == 15
    warned = [m for m in messages if "failed verification" in m]
    assert len(warned) == 1 and "step_00000015" in warned[0] and "xxh3-128" in warned[0]
    expected = read_model_tensors(straight_run / "checkpoints" / "step_00000015")
    got = read_model_tensors(run / "checkpoints" / "step_00000015")
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


@pytest.mark.journey
def test_with_no_valid_checkpoint_the_run_stops_with_a_clear_error(straight_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight_run / "checkpoints", run / "checkpoints")
    for checkpoint in list_checkpoints(run / "checkpoints"):
        (checkpoint / "model.safetensors").unlink()
    command = [sys.executable, "-m", "axtorch.train", *_overrides(run, straight_run.parent / "cache")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "no valid checkpoint" in result.stderr and "step_00000010: model.safetensors is missing" in result.stderr
    assert "Traceback" not in result.stderr


def test_retention_keeps_the_newest_and_every_nth(tmp_path, data_cache):
    _fit(
        tmp_path / "run",
        data_cache,
        "trainer.max_steps=20",
        "trainer.checkpoint_every=2",
        "trainer.keep_checkpoints=2",
        "trainer.keep_every=8",
    )
    steps = [int(p.name.removeprefix("step_")) for p in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert steps == [8, 16, 18, 20]


def _fail_saving_at_step(monkeypatch, step: int) -> None:
    real = checkpoint_module.save_file

    def save_file(tensors, filename, metadata=None):
        if f"step_{step:08d}" in str(filename):
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint_module, "save_file", save_file)


@pytest.mark.parametrize("saving", ["true", "false"], ids=["async", "sync"])
def test_a_full_disk_stops_the_run_and_leaves_earlier_checkpoints_intact(tmp_path, data_cache, monkeypatch, saving):
    _fail_saving_at_step(monkeypatch, 10)
    expected = r"writing checkpoint step_00000010 failed .*No space left on device.*earlier checkpoints are intact"
    with pytest.raises(CheckpointError, match=expected):
        _fit(tmp_path / "run", data_cache, f"trainer.async_checkpoint={saving}")
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["step_00000005"]  # no partial directory left behind
    assert checkpoint_problems(checkpoints / "step_00000005") == []


def test_a_full_disk_under_the_warn_policy_trains_on(tmp_path, data_cache, monkeypatch):
    _fail_saving_at_step(monkeypatch, 10)
    result, messages = _fit(tmp_path / "run", data_cache, "trainer.on_save_error=warn")
    assert result.step == 15
    assert any("No space left on device" in m and "training goes on" in m for m in messages)
    steps = [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert steps == ["step_00000005", "step_00000015"]


def test_the_ckpt_command_lists_steps_sizes_validity_and_digest(straight_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight_run / "checkpoints", run / "checkpoints")
    (run / "checkpoints" / "step_00000010" / "trainer_state.json").write_text("{}")
    assert ckpt_main(["list", str(run)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["5", "10", "15"]
    assert lines[1].split()[-1] == "ok" and "DAMAGED" in lines[2] and lines[3].endswith("ok")
    digest = json.loads((straight_run / "checkpoints" / "step_00000005" / "trainer_state.json").read_text())
    assert digest["config_digest"] in lines[1]
    assert ckpt_main(["verify", str(straight_run)]) == 0
    assert "3 of 3 checkpoints verified" in capsys.readouterr().out
