"""Which host of an XLA job this process is: the one place the xla backend learns it from.

On a TPU pod (or a Trainium cluster) each host runs one process that drives its own devices, and
the PJRT runtime says which host it is (``xr.process_index()`` of ``xr.process_count()``).
torch_xla's CPU client cannot join processes into one device set, so the tests simulate N hosts:
N processes under torchrun, each holding the whole N x k-device CPU mesh and acting as host
``RANK`` of ``WORLD_SIZE`` for the block of k devices a pod would give it. ``AXTORCH_XLA_SIMULATED_HOSTS=1``
asks for that. Everything host-specific in the backend (which rows it feeds, which checkpoint
pieces it writes, how the hosts find each other) reads the answer from here.

This module does not import torch_xla: the runtime's answer is passed in.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from axtorch.config.errors import ConfigError

SIMULATED_HOSTS_ENV = "AXTORCH_XLA_SIMULATED_HOSTS"
#: Set by GKE in each container of a multi-host TPU slice: the slice's hosts, comma-separated.
TPU_HOSTS_ENV = "TPU_WORKER_HOSTNAMES"
#: Set on Cloud TPU VMs: the slice's accelerator type, e.g. ``v5p-128``.
TPU_TYPE_ENV = "TPU_ACCELERATOR_TYPE"
#: What torchrun sets and a simulation needs (``env://`` reads the last two).
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class XlaHosts:
    index: int
    count: int
    #: A simulation: this process's runtime holds every host's devices (see the module's docstring).
    simulated: bool = False

    @property
    def init_method(self) -> str:
        """How the hosts' gloo group finds its members: torchrun's ``env://`` here, torch_xla's ``xla://`` on a pod."""
        return "env://" if self.simulated else "xla://"

    def check_feedable(self, sizes: dict[str, int]) -> None:
        """Refuse a mesh whose batches torch_xla's per-host transfer cannot feed, before the hosts meet.

        Each host sends its own rows (``minibatch=True``), the rows its devices hold, so the rows
        must split over the hosts; and that transfer splits only the batch dimension across
        hosts, so a sequence cut over ``seq`` cannot be fed on more than one host. A simulation
        sends the whole batch and would not fail: it is refused alike, as the pod would be.
        """
        if self.count == 1:
            return
        if sizes["seq"] > 1:
            raise ConfigError(
                "mesh.seq",
                sizes["seq"],
                f"1 with backend=xla on {self.count} hosts",
                reason="each host sends its own rows with torch_xla's per-host transfer (minibatch=True), "
                "which splits only the batch dimension across hosts; context parallelism over seq runs on one host",
            )
        if -1 not in (sizes["data"], sizes["fsdp"]) and (sizes["data"] * sizes["fsdp"]) % self.count:
            raise ConfigError(
                "mesh",
                f"data={sizes['data']} x fsdp={sizes['fsdp']}",
                f"a data x fsdp product that is a multiple of the {self.count} hosts",
                reason="each host feeds its own rows of the batch, the rows its devices hold",
            )

    def device_block(self, num_devices: int) -> range:
        """The global device ids this host drives: a contiguous block of the device order, as on a pod."""
        per_host = num_devices // self.count
        return range(self.index * per_host, (self.index + 1) * per_host)


def expected_host_count() -> Optional[int]:
    """The hosts an XLA job will have, where the environment says so before the runtime starts: a
    simulation's torchrun, a GKE TPU slice's host list, a TPU VM's accelerator type; else None."""
    if os.environ.get(SIMULATED_HOSTS_ENV) == "1" and os.environ.get("WORLD_SIZE", "").isdigit():
        return int(os.environ["WORLD_SIZE"])
    if hostnames := os.environ.get(TPU_HOSTS_ENV):
        return len([name for name in hostnames.split(",") if name.strip()])
    if accelerator := os.environ.get(TPU_TYPE_ENV):
        return tpu_slice_hosts(accelerator)
    return None


def tpu_slice_hosts(accelerator_type: str) -> Optional[int]:
    """Hosts of a TPU slice by its accelerator type (``v5p-128``, ``v5litepod-16``, ``v6e-8``); None for
    a generation not listed. Google's slice shapes: v4 and v5p count TensorCores (2 a chip), 4 chips
    a host; v5e and v6e count chips, 8 on one host up to 8, else 4 a host."""
    generation, _, size = accelerator_type.partition("-")
    if not size.isdigit():
        return None
    if generation in ("v4", "v5p"):
        return max(1, int(size) // 2 // 4)
    if generation in ("v5litepod", "v5lite", "v6e"):
        return 1 if int(size) <= 8 else int(size) // 4
    return None


def xla_hosts(runtime: Callable[[], tuple[int, int]]) -> XlaHosts:
    """This process's host: ``runtime()`` gives (index, count), unless ``AXTORCH_XLA_SIMULATED_HOSTS=1``."""
    value = os.environ.get(SIMULATED_HOSTS_ENV, "0")
    if value not in ("0", "1"):
        raise ConfigError(SIMULATED_HOSTS_ENV, value, "0 (the runtime's hosts) or 1 (torchrun's ranks act as hosts)")
    if value == "0":
        index, count = runtime()
        return XlaHosts(index, count)
    missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise ConfigError(
            SIMULATED_HOSTS_ENV,
            value,
            "a process started by torchrun",
            reason=f"simulated hosts take their index and count from torchrun, and {', '.join(missing)} is not set",
        )
    return XlaHosts(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), simulated=True)
