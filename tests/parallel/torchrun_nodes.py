"""Several nodes on this machine: launch/torchrun_multi_node.sh started once per node, as its header
documents, each node a host of its own (``network_hosts``: its own network namespace, address,
hostname and /etc/hosts), and a node lost whole. Shared by the tests that launch multi-node jobs."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from network_hosts import NetworkHosts
from process_tree import kill_process_tree
from torchrun_runs import TORCHRUN_EXECUTABLE

LAUNCHER = Path(__file__).resolve().parents[2] / "launch" / "torchrun_multi_node.sh"


def free_port() -> int:
    """A TCP port that nothing listens on now (the kernel's choice), for one job's rendezvous. The
    hosts' namespaces have ports of their own; a port free here keeps concurrent jobs apart."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Node:
    """One launcher started as one node, and the file its output goes to."""

    process: subprocess.Popen
    log: Path

    def wait(self, timeout: float) -> int:
        """The launcher's exit status; fails with the end of its log if it does not end in time."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_node(self)
            raise AssertionError(f"{self.log.name} still running after {timeout:g} s:\n{self.tail()}") from None

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def start_node(
    hosts: NetworkHosts,
    node_rank: int,
    nnodes: int,
    nproc: int,
    port: int,
    overrides: list[str],
    log: Path,
    *,
    rdzv_backend: str = "c10d",
    env: Optional[dict[str, str]] = None,
) -> Node:
    """Start the multi-node launcher on host ``node_rank`` as node ``node_rank`` of ``nnodes``, each
    with ``nproc`` CPU processes.

    The rendezvous is on host 0, by its name, at ``port``. ``overrides`` go to ``axtorch.train`` unchanged; the
    launcher's output goes to ``log``. ``env`` adds to or replaces the launcher's environment
    (e.g. ``RDZV_JOIN_TIMEOUT``). The launcher leads a session of its own, so that
    :func:`kill_node` can take the node down without touching the caller.
    """
    node_env = {
        **os.environ,
        "MASTER_ADDR": hosts.name(0),
        "MASTER_PORT": str(port),
        "NNODES": str(nnodes),
        "NPROC": str(nproc),
        "NODE_RANK": str(node_rank),
        "RDZV_BACKEND": rdzv_backend,
        "RDZV_ID": f"test-{port}",
        "TORCHRUN": str(TORCHRUN_EXECUTABLE),
        **(env or {}),
    }
    with log.open("w") as output:
        process = subprocess.Popen(
            hosts.command(node_rank, [str(LAUNCHER), *overrides]),
            stdout=output,
            stderr=subprocess.STDOUT,
            env=node_env,
            start_new_session=True,
        )
    return Node(process, log)


def start_nodes(
    hosts: NetworkHosts,
    nnodes: int,
    nproc: int,
    overrides: list[str],
    log_dir: Path,
    *,
    rdzv_backend: str = "c10d",
    env: Optional[dict[str, str]] = None,
    store_first: bool = True,
) -> list[Node]:
    """Start one job's ``nnodes`` nodes on hosts 0 .. nnodes-1 and a fresh port, logging to
    ``log_dir/node<i>.log``. Several jobs may share the hosts, as on a cluster.

    With ``store_first``, node 0 starts first and the others once its rendezvous store listens, so
    node 0 hosts the store, as MASTER_ADDR's node does on a cluster: under c10d the first launcher
    to bind the port hosts it, and which node is lost then decides how the others end. Without it
    all start at once (the static rendezvous's store is node 0's either way).
    """
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)

    def start(rank: int) -> Node:
        return start_node(
            hosts, rank, nnodes, nproc, port, overrides, log_dir / f"node{rank}.log", rdzv_backend=rdzv_backend, env=env
        )

    first = start(0)
    deadline = time.monotonic() + 120
    while store_first and not _listening(hosts.address(0), port):
        if first.process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"node 0 did not open its rendezvous store on port {port}:\n{first.tail()}")
        time.sleep(0.05)
    return [first, *(start(rank) for rank in range(1, nnodes))]


def _listening(address: str, port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex((address, port)) == 0


def kill_node(node: Node) -> None:
    """SIGKILL a node's launcher and all its processes at once, as a machine lost whole would go."""
    kill_process_tree(node.process.pid)
    node.process.wait()
