"""Preemption: a signal stops the run at a step boundary after saving, and the process exits 203
("resume me"); repeats never interrupt the save; a signal during start-up or after the last step;
every exit code of the command line; the resumed run equals an uninterrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from process_runs import logged_steps
from torchrun_runs import torchrun

from axtorch.cli import train as train_cli
from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.train.checkpoint import checkpoint_problems, list_checkpoints, read_model_tensors
from axtorch.train.checkpoint_manifest import CheckpointError
from axtorch.train.exit_codes import STATUS_FILE_ENV, ExitCode
from axtorch.train.numerics import NonFiniteError
from axtorch.train.preemption import PreemptionWatch
from axtorch.train.trainer import Trainer, TrainResult

PREEMPTIBLE = Path(__file__).parents[2] / "launch" / "preemptible.sh"


def _signal_self(*numbers: int) -> None:
    """Deliver signals to this process (Python runs the handlers in the main thread, as here)."""
    assert threading.current_thread() is threading.main_thread(), "a signal here would end the test process"
    for number in numbers:
        os.kill(os.getpid(), number)
        time.sleep(0.01)  # let the handler run before the next one


def test_the_first_signal_is_kept_and_repeats_are_ignored_with_a_line_until_the_outer_watch_ends(capfd):
    before = signal.getsignal(signal.SIGTERM)
    watch = PreemptionWatch()
    with watch:
        with watch:  # the trainer enters the command line's watch again
            _signal_self(signal.SIGTERM, signal.SIGTERM, signal.SIGINT)
        _signal_self(signal.SIGTERM)  # still watched: the outer entry holds the handlers
        assert signal.getsignal(signal.SIGTERM) == watch._request
    assert signal.getsignal(signal.SIGTERM) == before
    assert watch.signal_name == "SIGTERM"
    said = capfd.readouterr().err
    assert said.count("SIGTERM again, ignored") == 2 and said.count("SIGINT again, ignored") == 1, said
    assert "SIGKILL or SIGQUIT end it at once" in said


def test_the_command_lines_watch_ignores_a_repeat_that_arrives_while_the_process_exits(capfd):
    """A repeat sent just after the run saved and stopped must not turn exit 203 into a signal death."""
    before = signal.getsignal(signal.SIGTERM)
    watch = PreemptionWatch(until_exit=True)
    try:
        with watch:
            _signal_self(signal.SIGTERM)
        _signal_self(signal.SIGTERM)  # the run has ended; this process is exiting
        assert signal.getsignal(signal.SIGTERM) == watch._request
        assert capfd.readouterr().err.count("SIGTERM again, ignored") == 1
    finally:
        signal.signal(signal.SIGTERM, before)
    with PreemptionWatch(until_exit=True):
        pass  # no stop was asked: the handlers are given back as with any watch
    assert signal.getsignal(signal.SIGTERM) == before


def _trainer(run_dir: Path, cache: Path, *extra: str) -> Trainer:
    overrides = [
        "experiment=debug",
        f"run_dir={run_dir}",
        f"data.cache_dir={cache}",
        "trainer.progress_bar=false",
        "trainer.plot=false",
        "trainer.max_steps=6",
        "trainer.checkpoint_every=4",
        "trainer.eval_every=100",
        *extra,
    ]
    return Trainer(load_experiment_config(overrides))


def test_a_signal_during_start_up_stops_before_the_first_step_with_nothing_to_save(tmp_path, data_cache):
    with PreemptionWatch() as watch:
        _signal_self(signal.SIGTERM)  # while the command line composes and builds the trainer
        result = _trainer(tmp_path / "run", data_cache).fit(preemption=watch)
    assert (result.step, result.preempted_by, result.checkpoint) == (0, "SIGTERM", None)
    assert list_checkpoints(tmp_path / "run" / "checkpoints") == []


def test_a_signal_during_the_first_step_stops_after_it_with_its_checkpoint(tmp_path, data_cache):
    trainer = _trainer(tmp_path / "run", data_cache)
    train_step = trainer.train_step

    def first_step_signalled(batch):
        if trainer.step == 0:
            _signal_self(signal.SIGTERM)
        return train_step(batch)

    trainer.train_step = first_step_signalled
    result = trainer.fit()
    assert (result.step, result.preempted_by) == (1, "SIGTERM")
    assert [c.name for c in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000001"]
    assert checkpoint_problems(result.checkpoint) == []


def test_repeated_signals_during_a_save_leave_it_whole_and_the_run_stops_at_its_step(tmp_path, data_cache):
    """torch 2.9's torchrun passes on a SIGTERM that Slurm already sent each worker: two in a row."""
    trainer = _trainer(tmp_path / "run", data_cache, "trainer.async_checkpoint=false")
    save = trainer.checkpointer.save

    def save_while_signalled(*args, **kwargs):
        _signal_self(signal.SIGTERM, signal.SIGTERM, signal.SIGINT)
        return save(*args, **kwargs)

    trainer.checkpointer.save = save_while_signalled
    result = trainer.fit()
    assert (result.step, result.preempted_by) == (4, "SIGTERM")  # the periodic save at step 4
    assert [c.name for c in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000004"]
    assert checkpoint_problems(result.checkpoint) == []


def test_a_signal_as_the_last_step_ends_lets_the_run_finish(tmp_path, data_cache, capsys):
    trainer = _trainer(tmp_path / "run", data_cache)
    evaluate = trainer.evaluate

    def evaluate_while_signalled():
        if trainer.step == 6:
            _signal_self(signal.SIGTERM)
        return evaluate()

    trainer.evaluate = evaluate_while_signalled
    result = trainer.fit()
    assert (result.step, result.preempted_by) == (6, None) and result.final_eval_loss is not None
    assert "SIGTERM arrived as the last step ended: the run finished" in capsys.readouterr().out


class _FakeTrainer:
    """Stands in for the trainer: ``fit`` returns or raises what the case asks."""

    def __init__(self, outcome) -> None:
        self.outcome = outcome
        self.backend = SimpleNamespace(is_main_process=True, close=lambda: None)

    def fit(self, preemption: PreemptionWatch) -> TrainResult:
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


@pytest.mark.parametrize(
    ("outcome", "code"),
    [
        (TrainResult(Path("run"), 10, 5.0, 4.0, Path("run/checkpoints/step_00000010")), ExitCode.FINISHED),
        (TrainResult(Path("run"), 4, 5.0, None, Path("run/checkpoints/step_00000004"), "SIGTERM"), ExitCode.PREEMPTED),
        (CheckpointError("no checkpoint to resume from"), ExitCode.FAILED),
        (NonFiniteError("step 4: loss nan; saved the last good state at step 3"), ExitCode.NON_FINITE),
        (ConfigError("model", "(changed)", "the model the checkpoint was trained with"), ExitCode.CONFIG_ERROR),
    ],
    ids=["finished", "preempted", "failed", "non-finite", "config-error"],
)
def test_the_command_line_exits_with_the_code_of_how_the_run_ended(monkeypatch, tmp_path, outcome, code):
    monkeypatch.setattr(train_cli, "to_experiment_config", lambda cfg: cfg)
    monkeypatch.setattr(train_cli, "Trainer", lambda config: _FakeTrainer(outcome))
    monkeypatch.delenv(STATUS_FILE_ENV, raising=False)
    skipped_finalization = []

    def exit_process(status: int, skip_finalization: bool):
        skipped_finalization.append(skip_finalization)
        raise SystemExit(status)

    # A preempted run leaves with os._exit, which would end this test process: its choice is recorded.
    monkeypatch.setattr(train_cli, "exit_process", exit_process)
    if code is ExitCode.FINISHED:
        train_cli._train(None, PreemptionWatch())  # returns: the interpreter exits 0
        return
    with pytest.raises(SystemExit) as exited:
        train_cli._train(None, PreemptionWatch())
    assert exited.value.code == code
    # Under a launcher that reports the status itself, only a preemption changes: written, exit 0.
    status_file = tmp_path / "status"
    monkeypatch.setenv(STATUS_FILE_ENV, str(status_file))
    with pytest.raises(SystemExit) as exited:
        train_cli._train(None, PreemptionWatch())
    preempted = code is ExitCode.PREEMPTED
    assert exited.value.code == (0 if preempted else code)
    assert status_file.read_text() == "203\n" if preempted else not status_file.exists()
    assert skipped_finalization == [preempted, preempted]


def test_the_preempted_code_is_retryable_and_no_signal_death():
    """203: Kubeflow's ExitCode policy retries 128-255; a death by signal N is 128 + N, N <= 64."""
    assert 128 + 64 < ExitCode.PREEMPTED <= 255


def _command(run_dir: Path, cache: Path, launcher: list[str], *extra: str) -> list[str]:
    return [
        *launcher,
        "-m",
        "axtorch.train",
        "experiment=debug",
        f"run_dir={run_dir}",
        f"data.cache_dir={cache}",
        "trainer.max_steps=60",
        "trainer.checkpoint_every=100",
        "trainer.eval_every=100",
        "trainer.log_every=1",
        "trainer.progress_bar=false",
        "trainer.plot=false",
        *extra,
    ]


def _interrupt(command: list[str], run_dir: Path, *signals: int) -> subprocess.CompletedProcess:
    """Signal the run after its fifth step, each signal once the run has acknowledged the one
    before on stderr: a repeat sent sooner may merge with it (one pending signal of a kind)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: [stderr.append(line) for line in process.stderr], daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while logged_steps(run_dir) < 5 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    for number in signals:
        acknowledged = sum("axtorch: SIG" in line for line in stderr)
        process.send_signal(number)
        while sum("axtorch: SIG" in line for line in stderr) == acknowledged and time.monotonic() < deadline:
            if process.poll() is not None:
                break
            time.sleep(0.005)
    stdout = process.stdout.read()
    process.wait(timeout=300)
    reader.join(timeout=60)
    return subprocess.CompletedProcess(command, process.returncode, stdout, "".join(stderr))


def _catches(pid: int, number: int) -> bool:
    """Whether the process has a handler for signal ``number`` (its ``SigCgt`` mask in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        mask = next(line.split()[1] for line in status if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (number - 1) & 1)


@pytest.mark.journey
def test_a_process_signalled_as_it_starts_exits_203_not_by_the_signal(tmp_path, data_cache):
    """The command line, alone (no launcher's status file), signalled as soon as it watches for it:
    it stops before its first step and exits 203 itself, the code a scheduler restarts uncounted."""
    run_dir = tmp_path / "run"
    command = _command(run_dir, data_cache, [sys.executable])
    env = {name: value for name, value in os.environ.items() if name != STATUS_FILE_ENV}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while process.poll() is None and not _catches(process.pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 203, stdout[-2000:] + stderr[-3000:]
    assert "preempted by SIGTERM at step 0" in stdout and list_checkpoints(run_dir / "checkpoints") == []


def _preempted_checkpoint(result: subprocess.CompletedProcess, run_dir: Path, name: str = "SIGTERM") -> int:
    """The step the run stopped at: said, exit 203, and the checkpoint of that step whole."""
    assert result.returncode == ExitCode.PREEMPTED, result.stdout[-2000:] + result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("preempted by"))
    step = int(line.split(" at step ")[1].split(":")[0])
    assert line.startswith(f"preempted by {name} at step {step}: newest checkpoint ") and "exit 203" in line
    assert 5 <= step < 60
    checkpoint = list_checkpoints(run_dir / "checkpoints")[-1]
    assert checkpoint.name == f"step_{step:08d}" and checkpoint_problems(checkpoint) == []
    return step


def _assert_resumed_run_equals_uninterrupted(command, straight_command, run_dir: Path, straight_dir: Path) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    subprocess.run(straight_command, check=True, capture_output=True, timeout=600)
    expected = read_model_tensors(straight_dir / "checkpoints" / "step_00000060")
    got = read_model_tensors(run_dir / "checkpoints" / "step_00000060")
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


@pytest.mark.slow
@pytest.mark.journey
def test_a_sigterm_and_its_repeat_save_at_a_step_boundary_and_exit_resume_me(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    command = _command(run_dir, data_cache, [sys.executable])
    result = _interrupt(command, run_dir, signal.SIGTERM, signal.SIGTERM)
    _preempted_checkpoint(result, run_dir)
    assert "SIGTERM again, ignored" in result.stderr
    straight = _command(tmp_path / "straight", data_cache, [sys.executable])
    _assert_resumed_run_equals_uninterrupted(command, straight, run_dir, tmp_path / "straight")


@pytest.mark.slow
@pytest.mark.journey
def test_a_sigint_saves_at_a_step_boundary_and_exits_resume_me(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    result = _interrupt(_command(run_dir, data_cache, [sys.executable]), run_dir, signal.SIGINT)
    _preempted_checkpoint(result, run_dir, "SIGINT")


@pytest.mark.slow
@pytest.mark.journey
def test_under_torchrun_every_rank_stops_at_the_same_step_the_launcher_exits_203_and_the_resume_is_exact(
    tmp_path, data_cache
):
    """launch/preemptible.sh, as the launchers and the PyTorchJob run torchrun: the signal goes to
    it, torchrun passes it on and exits 1 itself; the workers agree on a step (a save whose ranks
    disagreed would hang), save, and report 203 through the wrapper."""
    launcher = [str(PREEMPTIBLE), *torchrun(2)]
    parallel = ("backend=native", "mesh.fsdp=2", "sharding=fsdp")
    run_dir = tmp_path / "run"
    command = _command(run_dir, data_cache, launcher, *parallel)
    result = _interrupt(command, run_dir, signal.SIGTERM)
    _preempted_checkpoint(result, run_dir)
    assert "the run was preempted and saved (command exit 1); exiting 203" in result.stderr
    straight = _command(tmp_path / "straight", data_cache, launcher, *parallel)
    _assert_resumed_run_equals_uninterrupted(command, straight, run_dir, tmp_path / "straight")
