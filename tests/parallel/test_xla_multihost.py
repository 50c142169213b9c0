"""The xla backend on several hosts, simulated: torchrun's processes each act as one host of a pod.

torch_xla's CPU client cannot join processes into one device set, so each process holds the
whole 4-device mesh and, with ``AXTORCH_XLA_SIMULATED_HOSTS=1``, acts as host RANK of 2 for
devices [2 x RANK, 2 x RANK + 2) (``axtorch/parallel/xla_hosts.py``; what this cannot catch is in
docs/parallelism.md). The hosts coordinate over gloo, feed their own rows, write their own
devices' checkpoint pieces and agree on a preemption.
"""

import math
import shutil
import signal
import subprocess

import psutil
import pytest
import torch
from debug_runs import STEPS, assert_weights_match_one_device, debug_overrides, train_losses, train_on_one_device
from torchrun_runs import torchrun
from xla_runs import ROOT, XLA_PYTHON, needs_xla, preempted_checkpoint, run_worker, wait_for_steps, xla_env

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.data.loader import build_data
from axtorch.parallel.mesh import MeshConfig
from axtorch.parallel.xla_hosts import (
    SIMULATED_HOSTS_ENV,
    TPU_HOSTS_ENV,
    TPU_TYPE_ENV,
    XlaHosts,
    expected_host_count,
    tpu_slice_hosts,
    xla_hosts,
)
from axtorch.train.checkpoint import (
    MODEL,
    OPTIMIZER,
    checkpoint_problems,
    read_index,
)
from axtorch.train.trainer import Trainer

pytestmark = pytest.mark.journey

HOSTS, DEVICES = 2, 4  # 2 devices per host
_FSDP4 = ("mesh.fsdp=4", "sharding=fsdp")
_HOST_FILES = {
    prefix: [f"{prefix}-{host:05d}-of-{HOSTS:05d}.safetensors" for host in range(HOSTS)]
    for prefix in (MODEL, OPTIMIZER)
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """One device to step 8; 2 hosts to step 5 (saving asynchronously, over the side channel);
    their checkpoint resumed to step 8 on one xla host and on the single backend."""
    root = tmp_path_factory.mktemp("xla_hosts")
    cache = data_cache
    train_on_one_device(root / "single", cache)
    hosts = run_worker(
        DEVICES,
        root / "two_hosts.json",
        STEPS,
        debug_overrides(root / "two_hosts", cache, *_FSDP4, "trainer.async_checkpoint=true"),
        hosts=HOSTS,
    )
    for target in ("one_host", "single_resumed"):
        shutil.copytree(root / "two_hosts" / "checkpoints", root / target / "checkpoints")
    (one_host,) = run_worker(
        DEVICES, root / "one_host.json", STEPS + 3, debug_overrides(root / "one_host", cache, *_FSDP4)
    )
    Trainer(load_experiment_config(debug_overrides(root / "single_resumed", cache))).fit()
    Trainer(load_experiment_config(debug_overrides(root / "single", cache))).fit()
    return root, hosts, one_host


@needs_xla
@pytest.mark.slow
def test_two_hosts_train_as_one_device(runs):
    root, hosts, _ = runs
    assert [report["host"] for report in hosts] == [[host, HOSTS] for host in range(HOSTS)]
    assert all(report["step"] == STEPS and report["devices_per_process"] == DEVICES // HOSTS for report in hosts)
    two_hosts = train_losses(root / "two_hosts")  # host 0 alone writes metrics.jsonl
    assert len(two_hosts) == STEPS
    torch.testing.assert_close(
        torch.tensor(two_hosts), torch.tensor(train_losses(root / "single")[:STEPS]), rtol=1e-5, atol=1e-5
    )


@needs_xla
@pytest.mark.slow
def test_each_host_feeds_the_rows_of_its_own_devices(runs, data_cache):
    """Host i's devices hold rows [8i, 8i + 8) of the 16-row batch over fsdp=4: its loader gave exactly
    those, and after the transfer its own two devices hold them, a quarter of the batch each (rows
    that landed on another host's devices would not be there)."""
    root, hosts, _ = runs
    config = load_experiment_config(debug_overrides(root / "single", data_cache))
    batch_size = config.trainer.batch_size
    first = next(build_data(config.data).train_batches(batch_size))["input_ids"]
    per_host, per_device = batch_size // HOSTS, batch_size // DEVICES
    for host, report in enumerate(hosts):
        own_rows = first[host * per_host : (host + 1) * per_host]
        assert torch.equal(torch.tensor(report["fed_rows"]), own_rows), host
        # This host's rows, sent to the devices: the global batch, each device holding a quarter.
        assert report["batch_shards"] == [[per_device, config.data.seq_len]] * DEVICES
        own_devices = [f"CPU:{device}" for device in range(host * DEVICES // HOSTS, (host + 1) * DEVICES // HOSTS)]
        assert sorted(report["device_rows"]) == own_devices, host
        for index, device in enumerate(own_devices):
            expected = own_rows[index * per_device : (index + 1) * per_device]
            assert torch.equal(torch.tensor(report["device_rows"][device]), expected), (host, device)


@needs_xla
@pytest.mark.slow
def test_each_host_writes_its_own_devices_pieces_and_together_every_piece_once(runs):
    root, _, _ = runs
    checkpoint = root / "two_hosts" / "checkpoints" / f"step_{STEPS:08d}"
    assert checkpoint_problems(checkpoint) == []
    for prefix, files in _HOST_FILES.items():
        index = read_index(checkpoint, prefix)
        for name, entry in index.items():
            pieces = entry["pieces"]
            offsets = [tuple(piece["offsets"]) for piece in pieces]
            assert len(set(offsets)) == len(offsets), (name, offsets)  # no block twice
            assert sum(math.prod(piece["shape"]) for piece in pieces) == math.prod(entry["shape"]), name
        # fsdp=4 splits a matrix's rows over devices 0-3: host 0 holds the first two blocks, host 1 the last two.
        matrix = index["decoder.layers.0.attention.q_proj.weight" + ("/exp_avg" if prefix == OPTIMIZER else "")]
        quarter = matrix["shape"][0] // DEVICES
        by_file = {file: sorted(p["offsets"][0] for p in matrix["pieces"] if p["file"] == file) for file in files}
        assert by_file == {files[0]: [0, quarter], files[1]: [2 * quarter, 3 * quarter]}
    # Whole tensors (a replicated norm, the optimizer's step count) come from host 0 alone.
    assert [p["file"] for p in read_index(checkpoint, MODEL)["decoder.final_norm.weight"]["pieces"]] == [
        _HOST_FILES[MODEL][0]
    ]
    step_count = read_index(checkpoint, OPTIMIZER)["decoder.final_norm.weight/step"]["pieces"]
    assert [p["file"] for p in step_count] == [_HOST_FILES[OPTIMIZER][0]]
    assert_weights_match_one_device(checkpoint, root / "single" / "checkpoints" / checkpoint.name, "two hosts")


@needs_xla
@pytest.mark.slow
def test_the_two_hosts_checkpoint_resumes_on_one_xla_host_and_on_one_device(runs):
    root, _, one_host = runs
    reference = train_losses(root / "single")[STEPS:]
    assert len(reference) == 3 and one_host["step"] == STEPS + 3
    for resumed in ("one_host", "single_resumed"):
        torch.testing.assert_close(
            torch.tensor(train_losses(root / resumed)), torch.tensor(reference), rtol=1e-5, atol=1e-5, msg=resumed
        )


@needs_xla
@pytest.mark.slow
def test_a_sigterm_to_one_host_stops_both_at_the_same_step_with_one_checkpoint(tmp_path, data_cache):
    """Only host 1 is signalled; both hosts agree on the step, save together and exit 203. Each
    pod host is its own first process; here torchrun stands in for the hosts, so
    launch/preemptible.sh gives its status as a pod's would be."""
    run_dir = tmp_path / "run"
    overrides = debug_overrides(run_dir, data_cache, *_FSDP4, "trainer.max_steps=500")
    hosts = [str(ROOT / "launch" / "preemptible.sh"), *torchrun(HOSTS, XLA_PYTHON)]
    command = [*hosts, "-m", "axtorch.train", "backend=xla", *overrides]
    launcher = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=xla_env(DEVICES, HOSTS), cwd=ROOT
    )
    wait_for_steps(launcher, run_dir)
    (host1,) = [p for p in psutil.Process(launcher.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
    host1.send_signal(signal.SIGTERM)
    checkpoint = preempted_checkpoint(launcher, run_dir)
    files = {p["file"] for entry in read_index(checkpoint).values() for p in entry["pieces"]}
    assert files == set(_HOST_FILES[MODEL])


def test_hosts_come_from_the_runtime_unless_a_simulation_asks_for_torchrun_ranks(monkeypatch):
    monkeypatch.delenv(SIMULATED_HOSTS_ENV, raising=False)
    assert xla_hosts(lambda: (3, 4)) == XlaHosts(3, 4) and XlaHosts(3, 4).init_method == "xla://"
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(SIMULATED_HOSTS_ENV, "1")
    hosts = xla_hosts(lambda: (0, 1))  # the CPU runtime's answer, overridden
    assert hosts == XlaHosts(1, 2, simulated=True) and hosts.init_method == "env://"
    assert hosts.device_block(8) == range(4, 8)
    monkeypatch.setenv(SIMULATED_HOSTS_ENV, "yes")
    with pytest.raises(ConfigError, match=r"AXTORCH_XLA_SIMULATED_HOSTS='yes'.*allowed: 0 .* or 1"):
        xla_hosts(lambda: (0, 1))
    monkeypatch.setenv(SIMULATED_HOSTS_ENV, "1")
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ConfigError, match="MASTER_PORT is not set; allowed: a process started by torchrun"):
        xla_hosts(lambda: (0, 1))


def test_a_mesh_the_hosts_cannot_feed_is_refused_naming_the_key():
    def refusal(hosts: int, **axes: int) -> str:
        try:
            XlaHosts(0, hosts).check_feedable(MeshConfig(**axes).resolve(8, "mesh"))
        except ConfigError as error:
            return str(error)
        return ""

    assert refusal(1, fsdp=4, seq=2) == ""  # one host: context parallelism is fine
    assert refusal(2, fsdp=8) == ""
    said = refusal(2, fsdp=4, seq=2)
    assert "mesh.seq=2" in said and "1 with backend=xla on 2 hosts" in said, said
    assert "splits only the batch dimension across hosts" in said, said
    said = refusal(8, fsdp=4, model=2)
    assert "mesh='data=1 x fsdp=4'" in said and "a multiple of the 8 hosts" in said, said


def test_composition_refuses_what_the_hosts_named_by_the_environment_cannot_feed(monkeypatch):
    """GKE names a TPU slice's hosts, a simulation's torchrun its ranks: the refusal comes at
    composition, before any device is touched; where only the runtime knows, the backend refuses."""

    def composed(*overrides: str) -> str:
        try:
            load_experiment_config(["experiment=debug", "backend=xla", *overrides])
        except ConfigError as error:
            return str(error)
        return ""

    for name in (TPU_HOSTS_ENV, TPU_TYPE_ENV, SIMULATED_HOSTS_ENV, "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert expected_host_count() is None and composed("mesh.seq=2") == ""
    monkeypatch.setenv(TPU_HOSTS_ENV, "t1v-n-0,t1v-n-1,t1v-n-2,t1v-n-3")
    assert expected_host_count() == 4
    said = composed("mesh.fsdp=-1", "mesh.seq=2")
    assert "mesh.seq=2" in said and "1 with backend=xla on 4 hosts" in said, said
    said = composed("mesh.fsdp=2", "mesh.model=2", "sharding=fsdp_tp")
    assert "mesh='data=1 x fsdp=2'" in said and "a multiple of the 4 hosts" in said, said
    assert composed("mesh.fsdp=-1", "mesh.model=2", "sharding=fsdp_tp") == ""  # resolved by the runtime
    monkeypatch.delenv(TPU_HOSTS_ENV)
    monkeypatch.setenv(SIMULATED_HOSTS_ENV, "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert expected_host_count() == 2 and "on 2 hosts" in composed("mesh.fsdp=2", "mesh.seq=2")
    monkeypatch.delenv(SIMULATED_HOSTS_ENV)
    monkeypatch.setenv(TPU_TYPE_ENV, "v5p-128")  # a TPU VM: 64 chips, 4 a host
    assert expected_host_count() == 16 and "on 16 hosts" in composed("mesh.fsdp=-1", "mesh.seq=2")


@pytest.mark.parametrize(
    ("accelerator", "hosts"),
    [
        *[("v4-8", 1), ("v4-32", 4), ("v5p-8", 1), ("v5p-1024", 128), ("v5litepod-8", 1), ("v5litepod-16", 4)],
        *[("v6e-4", 1), ("v6e-256", 64), ("v7x-64", None), ("v5p", None)],
    ],
)
def test_a_tpu_slices_hosts_follow_from_its_accelerator_type(accelerator, hosts):
    assert tpu_slice_hosts(accelerator) == hosts


@needs_xla
@pytest.mark.parametrize(
    ("axes", "refusal"),
    [
        (("mesh.model=2", "sharding=fsdp_tp"), "invalid config mesh='data=1 x fsdp=1': each host feeds its own rows"),
        (("mesh.seq=2",), "invalid config mesh.seq=2"),
    ],
    ids=["rows", "sequence"],
)
def test_a_mesh_the_hosts_cannot_feed_is_refused_before_the_hosts_meet(tmp_path, data_cache, axes, refusal):
    """Host 0 of 2, 1 device each. rows: model=2 puts every row on both devices, so no host has rows
    of its own; sequence: seq=2 cuts each sequence over the two hosts. The refusal comes before the
    gloo rendezvous, so host 0 alone (torchrun's variables set by hand) says it."""
    overrides = debug_overrides(tmp_path / "run", data_cache, *axes)
    torchrun_said = {"RANK": "0", "WORLD_SIZE": str(HOSTS), "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}
    env = {**xla_env(HOSTS, HOSTS), **torchrun_said}
    command = [str(XLA_PYTHON), "-m", "axtorch.train", "backend=xla", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 2, result.stderr[-3000:]
    assert refusal in result.stderr, result.stderr[-3000:]
