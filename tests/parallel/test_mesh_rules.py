"""Mesh rules: the hardware id, the rule it selects, what the rule sets, and the errors."""

import os
import subprocess
import sys

import pytest
import torch
import yaml

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.parallel import hardware as hardware_module
from axtorch.parallel.chips import CHIPS, chip_named
from axtorch.parallel.hardware import detect_hardware_id, device_count
from axtorch.train.config import Precision

BY_HARDWARE = ["experiment=debug", "mesh_rules=by_hardware"]


def _config(hardware, *overrides):
    return load_experiment_config([*BY_HARDWARE, f"mesh_rules.hardware={hardware}", *overrides])


def test_this_machine_is_identified_by_its_cores_and_hosts(monkeypatch):
    for variable in ("TPU_ACCELERATOR_TYPE", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, on a GPU one too
    assert detect_hardware_id() == f"cpu-{os.cpu_count()}x1"
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert detect_hardware_id() == f"cpu-{os.cpu_count()}x4"
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-256")
    assert detect_hardware_id() == "tpu-v5e-256"


@pytest.mark.parametrize(
    ("hardware", "devices"),
    [
        ("gpu-H100-8x32", 256),
        ("tpu-v5e-256", 256),
        ("tpu-v5p-512", 256),
        ("trn2-64x4", 256),
        ("trn2-lnc1-128x4", 512),
        ("trn1-32x2", 64),
        ("cpu-2x1", 2),
    ],
)
def test_a_hardware_id_counts_its_devices(hardware, devices):
    assert device_count(hardware) == devices


@pytest.mark.parametrize(
    ("instance", "lnc", "hardware"),
    [
        ("trn2.48xlarge", None, "trn2-64x2"),  # 16 chips, 4 logical NeuronCores each at the default LNC=2
        ("trn2.48xlarge", "1", "trn2-lnc1-128x2"),
        ("trn1.32xlarge", None, "trn1-32x2"),  # 16 chips of 2 NeuronCores
    ],
)
def test_a_trainium_host_is_identified_by_its_neuroncores(monkeypatch, instance, lnc, hardware):
    for variable in ("TPU_ACCELERATOR_TYPE", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "NEURON_LOGICAL_NC_CONFIG"):
        monkeypatch.delenv(variable, raising=False)
    if lnc is not None:
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", lnc)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(hardware_module.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hardware_module, "ec2_instance_type", lambda: instance)
    assert detect_hardware_id() == hardware


#: What each kind of machine reports, as detect_hardware_id reads it: (torch.cuda's device name,
#: TPU_ACCELERATOR_TYPE, EC2 instance type). Every chip of the catalogue must appear.
REPORTED = [
    ("NVIDIA B200", None, None),
    ("NVIDIA H200", None, None),
    ("NVIDIA H100 NVL", None, None),
    ("NVIDIA H100 PCIe", None, None),
    ("NVIDIA H100 80GB HBM3", None, None),
    ("NVIDIA A100-SXM4-80GB", None, None),
    ("AMD Instinct MI300X", None, None),
    (None, "v6e-64", None),
    (None, "v5litepod-64", None),
    (None, "v5litepod-256", None),
    (None, "v5p-128", None),
    (None, "v4-32", None),
    (None, None, "trn1.2xlarge"),
    (None, None, "trn1.32xlarge"),
    (None, None, "trn1n.32xlarge"),
    (None, None, "trn2.48xlarge"),
    (None, None, "trn2u.48xlarge"),
]


def test_the_reported_machines_cover_every_chip_of_the_catalogue():
    named = {chip_named(gpu or tpu or instance).name for gpu, tpu, instance in REPORTED}
    assert named == {chip.name for chip in CHIPS}


@pytest.mark.parametrize(("gpu", "tpu", "instance"), REPORTED, ids=lambda value: value)
def test_every_real_machine_gets_a_rule_for_its_backend(monkeypatch, gpu, tpu, instance):
    """The id each machine reports selects a rule, which picks the backend its chip runs (a
    trn1n or trn2u instance once matched no rule and the run stopped at start-up)."""
    for variable in ("TPU_ACCELERATOR_TYPE", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "NEURON_LOGICAL_NC_CONFIG"):
        monkeypatch.delenv(variable, raising=False)
    if tpu:
        monkeypatch.setenv("TPU_ACCELERATOR_TYPE", tpu)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(hardware_module.torch.cuda, "is_available", lambda: gpu is not None)
    monkeypatch.setattr(hardware_module.torch.cuda, "get_device_name", lambda index=0: gpu)
    monkeypatch.setattr(hardware_module.torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(hardware_module, "ec2_instance_type", lambda: instance)
    hardware = detect_hardware_id()
    config = _config(hardware)
    assert config.mesh_rules.selected not in (None, "cpu-.*"), hardware
    assert config.backend.value == chip_named(gpu or tpu or instance).backend, hardware


@pytest.mark.parametrize(
    ("hardware", "selected", "backend", "mesh", "sharding"),
    [
        ("tpu-v5e-256", "tpu-v5e-256", "xla", {"data": 1, "fsdp": -1}, "fsdp"),
        ("tpu-v6e-64", "tpu-v6e-.*", "xla", {"fsdp": -1}, "fsdp"),
        ("gpu-H100-8x32", "gpu-H(100|200)-8x(3[2-9]|[4-9][0-9]|[0-9]{3,})", "native", {"data": -1, "fsdp": 8}, "fsdp"),
        ("gpu-H200-8x2", "gpu-H(100|200)-.*", "native", {"data": 1, "fsdp": -1}, "fsdp"),
        ("gpu-A100-4x1", "gpu-.*", "native", {"fsdp": -1}, "fsdp"),
        ("trn2-64x4", "trn2u?-.*", "xla", {"fsdp": -1}, "fsdp"),
        ("trn1-32x2", "trn1n?-.*", "xla", {"fsdp": -1}, "fsdp"),
        ("cpu-2x1", "cpu-.*", "single", {"data": 1, "fsdp": 1}, "replicated"),
    ],
)
def test_each_cluster_gets_the_first_rule_that_matches_its_id(hardware, selected, backend, mesh, sharding):
    config = _config(hardware)
    assert (config.mesh_rules.hardware, config.mesh_rules.selected) == (hardware, selected)
    assert config.backend.value == backend
    assert {axis: getattr(config.mesh, axis) for axis in mesh} == mesh
    preset = load_experiment_config(["experiment=debug", f"sharding={sharding}"]).sharding
    assert (config.sharding.parameters, config.sharding.activations) == (preset.parameters, preset.activations)
    assert config.trainer.precision == (Precision.fp32 if backend == "single" else Precision.bf16)


def test_the_command_line_wins_over_the_rule():
    config = _config("gpu-H100-8x4", "trainer.precision=fp32", "mesh.fsdp=4", "sharding=replicated")
    assert config.trainer.precision == Precision.fp32 and config.mesh.fsdp == 4
    assert (
        config.sharding.parameters
        == load_experiment_config(["experiment=debug", "sharding=replicated"]).sharding.parameters
    )
    assert config.backend.value == "native"  # what the command line left to the rule


def test_no_matching_rule_is_an_error_that_lists_the_rules():
    with pytest.raises(ConfigError, match=r"mesh_rules\.hardware='abacus-1x1'.*'tpu-v5e-256', 'tpu-v5e-\.\*'"):
        _config("abacus-1x1")


def test_a_rule_that_is_not_a_regular_expression_is_named():
    with pytest.raises(ConfigError, match=r"mesh_rules\.rules\[0\]\.hardware='gpu-\('"):
        load_experiment_config(
            ["experiment=debug", "mesh_rules.rules=[{hardware: 'gpu-(', overrides: []}]", "mesh_rules.hardware=x"]
        )


def test_without_rules_nothing_is_selected():
    config = load_experiment_config(["experiment=debug"])
    assert config.mesh_rules.rules == [] and config.mesh_rules.selected is None


@pytest.mark.journey
def test_the_training_command_prints_and_records_the_rule(tmp_path, data_cache):
    command = [
        sys.executable,
        "-m",
        "axtorch.train",
        *BY_HARDWARE,
        f"run_dir={tmp_path / 'run'}",
        f"data.cache_dir={data_cache}",
        "trainer.max_steps=1",
        "trainer.progress_bar=false",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    hardware = detect_hardware_id()
    assert f"mesh rule 'cpu-.*' for hardware {hardware}" in result.stdout
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["mesh_rules"]
    assert (recorded["selected"], recorded["hardware"]) == ("cpu-.*", hardware)


@pytest.mark.journey
def test_the_planner_sizes_a_simulated_cluster_from_its_id():
    command = [
        sys.executable,
        "-m",
        "axtorch.plan",
        "model=llama3_8b",
        *BY_HARDWARE[1:],
        "mesh_rules.hardware=gpu-H100-8x4",
        "check=false",  # the sizing is the point here; the dry run's check is test_plan_check.py's
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "mesh: pipe=1 data=1 fsdp=32 seq=1 expert=1 model=1 (32 devices)" in result.stdout


def test_the_old_name_golden_composes_the_same_rules_with_a_deprecation_warning():
    with pytest.warns(FutureWarning, match="mesh_rules=golden is deprecated .* use mesh_rules=by_hardware"):
        old = load_experiment_config(["experiment=debug", "mesh_rules=golden", "mesh_rules.hardware=tpu-v5p-512"])
    assert old == _config("tpu-v5p-512")
