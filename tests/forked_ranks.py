"""The ranks of one gloo group, forked from an interpreter that has imported torch and axtorch already.

A torchrun launch pays for its agent's interpreter and, in every rank, for importing torch, axtorch,
Hydra and ``torch._dynamo`` (about 4 CPU-seconds a rank: most of a small parity case on 2 cores).
Parity tests check what the ranks compute, not how they were started, so they fork their ranks from
one multiprocessing fork server per test process, which imports those modules once. Each rank gets
the environment ``torchrun --standalone`` gives a worker and runs its script as ``__main__``, in a
process of its own. What the launcher itself does (restarts, signals, rendezvous across hosts, the
scripts under ``launch/``) stays tested with torchrun (``torchrun_runs.py``).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import runpy
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import psutil
from suite_timing import count_unwaited_cpu_seconds
from tiers import check_journey

#: What every rank imports; the fork server imports it once, before it forks any rank.
PRELOADED = (
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "hydra",
    "axtorch.compose.experiment_loader",
    "axtorch.train.trainer",
)

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(list(PRELOADED))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_main(program: tuple[str, ...], env: dict[str, str], log: str, cwd: str | None) -> None:
    """One rank: torchrun's worker environment, its output in ``log``, then the program as ``__main__``."""
    with open(log, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if program[0] == "-m":
        sys.argv = [program[1], *program[2:]]
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(program)
        runpy.run_path(program[0], run_name="__main__")


def run_ranks(
    processes: int,
    *program: str,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 600,
    tail: int = 3000,
) -> None:
    """Run ``program`` (a script and its arguments, or ``-m module ...``, as for torchrun) as ranks
    0..processes-1 of one group on this machine, and require that each exits 0.

    As torchrun does, the first rank to fail stops the others (they would wait in a collective for
    the group's timeout); the assertion shows the last ``tail`` characters of each rank's output.
    """
    check_journey([sys.executable, *program])
    worker_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(processes),
        "LOCAL_WORLD_SIZE": str(processes),
        "GROUP_RANK": "0",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1") if processes == 1 else "1",
        **(env or {}),
    }
    spent_before = _fork_server_cpu_seconds()
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        ranks = []
        for rank in range(processes):
            rank_env = {**worker_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            log = os.path.join(logs, f"rank{rank}.log")
            process = _CONTEXT.Process(target=_rank_main, args=(program, rank_env, log, cwd and str(cwd)))
            process.start()
            ranks.append((process, log))
        failed = _wait(ranks, timeout)
        count_unwaited_cpu_seconds(_fork_server_cpu_seconds() - spent_before)
        if failed:
            outputs = "\n".join(
                f"--- rank {rank} (exit {process.exitcode}):\n{Path(log).read_text()[-tail:]}"
                for rank, (process, log) in enumerate(ranks)
            )
            raise AssertionError(f"{' '.join(program)}: {failed}\n{outputs}")


def _fork_server_cpu_seconds() -> float:
    """CPU seconds of the fork server and of the ranks it has waited for (this process waits for neither)."""
    for child in psutil.Process().children():
        if "multiprocessing.forkserver" in " ".join(child.cmdline()):
            times = child.cpu_times()
            return times.user + times.system + times.children_user + times.children_system
    return 0.0


def _wait(ranks: list[tuple[multiprocessing.process.BaseProcess, str]], timeout: float) -> str:
    """Wait for every rank; on the first failure or at the timeout, kill the rest. Empty if all exited 0."""
    deadline = time.monotonic() + timeout
    while any(process.is_alive() for process, _ in ranks):
        if any(process.exitcode not in (None, 0) for process, _ in ranks):
            break
        if time.monotonic() > deadline:
            break
        multiprocessing.connection.wait([process.sentinel for process, _ in ranks], timeout=0.5)
    for process, _ in ranks:
        if process.is_alive():
            process.kill()
        process.join()
    codes = [process.exitcode for process, _ in ranks]
    if all(code == 0 for code in codes):
        return ""
    if time.monotonic() > deadline:
        return f"ranks still running after {timeout:.0f} s were stopped (exit codes {codes})"
    return f"a rank failed (exit codes {codes})"
