"""A Slurm cluster of several nodes (Debian's slurm-wlm: munged, slurmctld, a slurmd per node) for the
launcher tests.

Each node is a host of its own (``network_hosts``: a network namespace with its own address on a
bridge, its own hostname and /etc/hosts), running its own slurmd; slurmctld runs on this machine
and reaches them over the bridge, so a job's nodes meet by name as on a cluster. CI runs as root
on a fresh machine, so the set-up installs the packages itself (apt-get, about 30 s; nothing when
they are installed) and starts the daemons with a configuration of their own in a temporary
directory, on free ports: the machine's /etc/slurm is not touched. Jobs are tracked by
proctrack/linuxproc (process parentage): a container has no cgroup for Slurm to manage.

Two clusters may be alive at once (``make test`` runs the suites of two torch versions side by
side): each has its own daemons, ports, subnet and state, and they share the one munged of the
machine, which a lock file (``MUNGE_LOCK``) keeps running until the last of them stops.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Optional

from network_hosts import NetworkHosts

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch")
#: The daemons live in /usr/sbin, which a CI user's PATH may lack.
PATH = f"{os.environ.get('PATH', '')}:/usr/sbin"
#: Held shared by every cluster alive on this machine; exclusively to install Slurm, to start
#: munged, and by the last cluster to stop the munged that one of them started (its pid beside).
MUNGE_LOCK = Path(tempfile.gettempdir()) / "axtorch-slurm-munge.lock"
STARTED_MUNGED = MUNGE_LOCK.with_suffix(".pid")
#: Job states after which a job record changes no more (unless something requeues it).
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


def missing_programs() -> list[str]:
    return [name for name in PROGRAMS if shutil.which(name, path=PATH) is None]


def install() -> None:
    """Install Slurm and munge with apt-get unless they are there (needs root), one session at a time."""
    if not missing_programs():
        return  # without the lock: a cluster alive holds it shared
    with MUNGE_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if missing_programs():
            _apt_install()


def _apt_install() -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True, timeout=600)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
        check=True,
        env=env,
        capture_output=True,
        timeout=900,
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.5)


class SlurmCluster:
    """slurmctld on this machine and ``nodes`` nodes of its CPUs each, in one partition."""

    def __init__(self, root: Path, nodes: int = 2) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "PATH": PATH, "SLURM_CONF": str(self.conf)}
        self.hosts = NetworkHosts(nodes, root / "hosts")
        self._munge_lock: Optional[IO[str]] = None

    @property
    def node_names(self) -> list[str]:
        return [self.hosts.name(index) for index in range(self.hosts.count)]

    def start(self) -> None:
        self._start_munge()
        self.hosts.__enter__()
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        nodes = [
            f"NodeName={name} NodeAddr={self.hosts.address(index)} CPUs={os.cpu_count()} State=UNKNOWN"
            for index, name in enumerate(self.node_names)
        ]
        for name in self.node_names:
            (self.root / "spool" / name).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=axtorch-test",
                    # This machine, by its own name (slurmctld checks it), at its address on the bridge.
                    f"SlurmctldHost={socket.gethostname().split('.')[0]}({self.hosts.bridge_address})",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "AuthType=auth/munge",
                    # How long slurmd refuses a job's revoked credentials, and so how long a requeued job
                    # waits before it may start again: 120 s by default.
                    "AuthInfo=cred_expire=10",
                    f"StateSaveLocation={self.root / 'state'}",
                    f"SlurmdSpoolDir={self.root / 'spool' / '%n'}",  # %n: the node's name
                    f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={self.root / 'slurmd-%n.pid'}",
                    f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.root / 'slurmd-%n.log'}",
                    "ProctrackType=proctrack/linuxproc",  # no cgroup to manage in a container
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SchedulerType=sched/builtin",  # start a job as soon as it fits, no backfill cycle
                    "SchedulerParameters=sched_interval=2",  # and a requeued one soon after its wait (60 s)
                    "ReturnToService=2",
                    "JobRequeue=1",
                    "SlurmdTimeout=20",  # a silent node is marked DOWN after (300 s by default)
                    "KillWait=30",  # SIGTERM to SIGKILL when a job is requeued: Slurm's default, what clusters run
                    "MinJobAge=3600",  # keep finished jobs' records for scontrol show job
                    "MpiDefault=none",
                    "SlurmdParameters=config_overrides",  # the node line's CPUs, whatever slurmd detects
                    *nodes,
                    "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        subprocess.run(["slurmctld", "-i"], check=True, env=self.env, timeout=60)
        for index in range(self.hosts.count):  # each slurmd on its host, named by the host's hostname
            subprocess.run(self.hosts.command(index, ["slurmd"]), check=True, env=self.env, timeout=60)
        try:
            _wait(self._nodes_idle, 60, "idle nodes")
        except TimeoutError as error:
            raise RuntimeError(f"{error}\n{self.logs()}") from error

    def bring_back(self, index: int) -> None:
        """Node ``index`` up again after a failure: its slurmd started, and Slurm told it may use it."""
        if not any(Path(f"/proc/{pid}/comm").read_text().strip() == "slurmd" for pid in self.hosts.pids(index)):
            subprocess.run(self.hosts.command(index, ["slurmd"]), check=True, env=self.env, timeout=60)
        _wait(lambda: "*" not in self._slurm("sinfo", "--noheader", "--Node", "--format=%T"), 60, "node responding")
        with contextlib.suppress(subprocess.CalledProcessError):  # a node that was never down
            self.scontrol("update", f"NodeName={self.hosts.name(index)}", "State=RESUME")
        _wait(self._nodes_idle, 60, "idle nodes")

    def _start_munge(self) -> None:
        """Use a running munged, else start one as the munge user (it refuses other keys' owners);
        then hold ``MUNGE_LOCK`` shared while this cluster lives."""
        self._munge_lock = MUNGE_LOCK.open("a")
        fcntl.flock(self._munge_lock, fcntl.LOCK_EX)
        try:
            if not self._munge_works():
                run_dir = Path("/run/munge")
                run_dir.mkdir(exist_ok=True)
                shutil.chown(run_dir, "munge", "munge")
                subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, env=self.env, timeout=60)
                _wait(self._munge_works, 30, "munged")
                STARTED_MUNGED.write_text((run_dir / "munged.pid").read_text())
        finally:
            fcntl.flock(self._munge_lock, fcntl.LOCK_SH)

    def _release_munge(self) -> None:
        """The last cluster alive stops the munged a cluster started; a munged found running stays."""
        if self._munge_lock is None:
            return
        with self._munge_lock:  # closing the file gives up this cluster's share
            try:
                fcntl.flock(self._munge_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another cluster still uses it
            if STARTED_MUNGED.exists():
                pid = int(STARTED_MUNGED.read_text())
                with contextlib.suppress(OSError):  # only a munged: the file may be older than this boot
                    if Path(f"/proc/{pid}/comm").read_text().strip() == "munged":
                        _terminate(pid)
                STARTED_MUNGED.unlink()
        self._munge_lock = None

    def _munge_works(self) -> bool:
        if not Path("/run/munge/munge.socket.2").exists():
            return False
        credential = subprocess.run(["munge", "-n"], capture_output=True, env=self.env, timeout=30)
        decoded = subprocess.run(["unmunge"], input=credential.stdout, capture_output=True, env=self.env, timeout=30)
        return credential.returncode == 0 and decoded.returncode == 0

    def stop(self) -> None:
        """End the daemons this cluster started, by their pid files."""
        pid_files = [self.root / f"slurmd-{name}.pid" for name in self.node_names]
        for pid_file in (*pid_files, self.root / "slurmctld.pid"):
            if pid_file.exists():
                _terminate(int(pid_file.read_text()))
        self._release_munge()
        self.hosts.__exit__(None, None, None)

    def _nodes_idle(self) -> bool:
        states = self._slurm("sinfo", "--noheader", "--Node", "--format=%T").split()
        return states == ["idle"] * self.hosts.count

    def _slurm(self, *command: str) -> str:
        return subprocess.run(command, check=True, capture_output=True, text=True, env=self.env, timeout=60).stdout

    def scontrol(self, *arguments: str) -> str:
        return self._slurm("scontrol", *arguments)

    def scancel(self, *arguments: str) -> str:
        return self._slurm("scancel", *arguments)

    def submit(self, sbatch_options: list[str], script: str, overrides: list[str], env: dict[str, str]) -> int:
        """``sbatch <options> <script> <overrides>`` from the repository root; the job's id."""
        result = subprocess.run(
            ["sbatch", "--parsable", *sbatch_options, script, *overrides],
            check=True,
            capture_output=True,
            text=True,
            env={**self.env, **env},
            cwd=Path(__file__).parents[2],
            timeout=60,
        )
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """The job's record (``scontrol show job``) as key=value pairs: JobState, Restarts, Comment..."""
        fields = self.scontrol("--oneliner", "show", "job", str(job_id)).split()
        return dict(field.split("=", 1) for field in fields if "=" in field)

    def wait_for(
        self, job_id: int, condition: Callable[[dict[str, str]], bool], what: str, timeout: float = 600
    ) -> None:
        try:
            _wait(lambda: condition(self.job(job_id)), timeout, f"job {job_id}: {what}")
        except TimeoutError as error:
            raise TimeoutError(f"{error}; last seen {self.job(job_id)}\n{self.logs()}") from error

    def wait_until_requeued(self, job_id: int, restarts: int) -> None:
        """Wait for the job's ``restarts``-th requeue (Slurm starts it again after ``cred_expire``)."""
        self.wait_for(
            job_id,
            lambda job: int(job["Restarts"]) >= restarts and job["JobState"] in ("PENDING", "RUNNING"),
            f"requeued {restarts} times",
        )

    def wait_until_finished(self, job_id: int) -> dict[str, str]:
        self.wait_for(job_id, lambda job: job["JobState"] in FINISHED, "finished")
        return self.job(job_id)

    def logs(self) -> str:
        tails = []
        for name in ("slurmctld.log", *(f"slurmd-{node}.log" for node in self.node_names)):
            path = self.root / name
            lines = path.read_text(errors="replace").splitlines()[-20:] if path.exists() else ["(none)"]
            tails.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(tails)


def _terminate(pid: int) -> None:
    try:
        os.kill(pid, 15)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
