"""Several hosts on this machine, for the multi-node tests: each a network namespace of its own with
its own address on a bridge the test creates, its own hostname, and an /etc/hosts that names them
all, so that "localhost" cannot hide a wrong address. The traffic stays inside them.

A host's processes run under ``nsenter --net`` (its network; not ``ip netns exec``, which mounts a
/sys of its own without the cgroup filesystem that slurmd needs) and ``unshare --uts --mount``
(its hostname, and its own view of /etc/hosts, bind-mounted from a file this creates); nothing of
the machine's own network, hostname or /etc/hosts changes. Needs root (CI runs as root).
"""

from __future__ import annotations

import fcntl
import subprocess
from pathlib import Path
from types import TracebackType
from typing import IO, Optional

#: 10.213.<subnet>.0/24: one subnet per ``NetworkHosts`` alive on this machine, held by a file lock.
_NETWORK = "10.213"
_SUBNETS = range(1, 250)
#: The bridge's own address in each subnet, from which the test process reaches the hosts.
_BRIDGE_HOST = 254
#: Run inside the namespaces: name this host, show it its /etc/hosts, then become the command.
_ENTER = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'


def _ip(*arguments: str) -> None:
    subprocess.run(["ip", *arguments], check=True, capture_output=True, text=True, timeout=30)


class NetworkHosts:
    """``count`` hosts named ``node0`` .. ``node{count-1}``; a context manager that removes them."""

    def __init__(self, count: int, directory: Path) -> None:
        self.count = count
        self.directory = directory
        self.subnet: Optional[int] = None
        self._lock: Optional[IO[str]] = None

    def name(self, index: int) -> str:
        return f"node{index}"

    def address(self, index: int) -> str:
        return f"{_NETWORK}.{self.subnet}.{index + 1}"

    @property
    def bridge_address(self) -> str:
        """The test process's own address on the hosts' network (the machine's side of the bridge)."""
        return f"{_NETWORK}.{self.subnet}.{_BRIDGE_HOST}"

    @property
    def hosts_file(self) -> Path:
        return self.directory / "hosts"

    def _namespace(self, index: int) -> str:
        return f"axtorch-{self.subnet}-{index}"

    def __enter__(self) -> NetworkHosts:
        self._claim_subnet()
        bridge = f"axb{self.subnet}"
        self.directory.mkdir(parents=True, exist_ok=True)
        names = "".join(f"{self.address(i)} {self.name(i)}\n" for i in range(self.count))
        self.hosts_file.write_text(f"127.0.0.1 localhost\n{names}")
        try:
            _ip("link", "add", bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_address}/24", "dev", bridge)
            _ip("link", "set", bridge, "up")
            for index in range(self.count):
                namespace, veth = self._namespace(index), f"axv{self.subnet}h{index}"
                _ip("netns", "add", namespace)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
                _ip("link", "set", veth, "master", bridge, "up")
                _ip("-n", namespace, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
                _ip("-n", namespace, "link", "set", "eth0", "up")
                _ip("-n", namespace, "link", "set", "lo", "up")
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._remove()

    def command(self, index: int, argv: list[str]) -> list[str]:
        """``argv`` as host ``index`` runs it: the same process, its network, name and /etc/hosts."""
        return [
            *("nsenter", f"--net=/run/netns/{self._namespace(index)}"),
            *("unshare", "--uts", "--mount", "--propagation", "private"),
            *("sh", "-c", _ENTER, self.name(index), str(self.hosts_file), *argv),
        ]

    def pids(self, index: int) -> list[int]:
        """Every process running on host ``index`` (in its network namespace)."""
        listed = subprocess.run(
            ["ip", "netns", "pids", self._namespace(index)], check=True, capture_output=True, text=True, timeout=30
        )
        return [int(pid) for pid in listed.stdout.split()]

    def _claim_subnet(self) -> None:
        """The first subnet no other live ``NetworkHosts`` holds (a lock ends with its process)."""
        for subnet in _SUBNETS:
            lock = open(f"/tmp/axtorch-network-hosts-{subnet}.lock", "w")  # noqa: SIM115 (held until _remove)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            self.subnet, self._lock = subnet, lock
            self._remove_links()  # left by a process that died holding this subnet
            return
        raise RuntimeError(f"no free subnet of {_NETWORK}.0.0/16 for test hosts")

    def _remove_links(self) -> None:
        """This subnet's namespaces (a veth goes with its namespace) and bridge, whoever made them."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        for namespace in (line.split()[0] for line in listed.splitlines() if line.strip()):
            if namespace.startswith(f"axtorch-{self.subnet}-"):
                subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", f"axb{self.subnet}"], capture_output=True, timeout=30)

    def _remove(self) -> None:
        if self._lock is None:
            return
        self._remove_links()
        self._lock.close()
        self._lock = None
