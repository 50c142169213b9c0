"""MFU's denominator: catalogue peaks per device by chip name and precision, a measured CPU peak, no MFU
(never a crash) for an unknown chip."""

from __future__ import annotations

import json
import threading
import time
import warnings

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.parallel.chips import chip_named
from axtorch.parallel.single import SingleDeviceBackend
from axtorch.train import curves as curves_module
from axtorch.train import peak_flops as peak_flops_module
from axtorch.train.flops import model_flops_per_token
from axtorch.train.peak_flops import cpu_peak_flops, datasheet_peak_flops, resolve_peak_flops
from axtorch.train.trainer import Trainer

T = 1e12


@pytest.mark.parametrize(
    ("runtime_name", "chip", "bf16", "fp32"),
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", 989.4 * T, 66.9 * T),
        ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe", 756 * T, 51.2 * T),
        ("NVIDIA H100 NVL", "NVIDIA H100 NVL", 835 * T, 60 * T),
        ("NVIDIA H200", "NVIDIA H200", 989.4 * T, 66.9 * T),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100", 312 * T, 19.5 * T),
        ("NVIDIA B200", "NVIDIA B200", 2250 * T, 75 * T),
        ("AMD Instinct MI300X", "AMD Instinct MI300X", 1307.4 * T, 163.4 * T),
        ("TPU v4", "TPU v4", 275 * T, 275 * T),
        ("TPU v5 lite", "TPU v5e", 197 * T, 197 * T),
        ("TPU v5", "TPU v5p", 459 * T, 459 * T),
        ("TPU v5p", "TPU v5p", 459 * T, 459 * T),
        ("TPU v6 lite", "TPU v6e", 918 * T, 918 * T),
        # Per NeuronCore, the device each process (native) or XLA device drives: a Trainium chip
        # has 2; a Trainium2 chip 8 physical, 4 logical at the default LNC=2.
        ("trn1.32xlarge", "AWS Trainium", 190 / 2 * T, 47.5 / 2 * T),
        ("trn2.48xlarge", "AWS Trainium2", 667 / 4 * T, 181 / 4 * T),
        ("trn2u.48xlarge", "AWS Trainium2", 667 / 4 * T, 181 / 4 * T),
    ],
)
def test_runtime_names_find_their_datasheet_peaks(runtime_name, chip, bf16, fp32, monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert chip_named(runtime_name).name == chip
    assert datasheet_peak_flops(runtime_name, torch.bfloat16) == pytest.approx(bf16)
    assert datasheet_peak_flops(runtime_name, torch.float32) == pytest.approx(fp32)


def test_fp8_peaks_where_the_chip_has_them_and_bf16_where_not():
    assert datasheet_peak_flops("NVIDIA H100 80GB HBM3", torch.float8_e4m3fn) == pytest.approx(1978.9 * T)
    assert datasheet_peak_flops("NVIDIA A100-SXM4-80GB", torch.float8_e4m3fn) == pytest.approx(312 * T)


def test_trainium2_counts_the_logical_neuroncores_the_runtime_is_set_to(monkeypatch):
    """64 processes on a trn2.48xlarge at LNC=2 share its 16 chips' peak; 128 at LNC=1 too."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert resolve_peak_flops(None, "trn2.48xlarge", torch.bfloat16, 64, 1) == pytest.approx(16 * 667 * T)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert resolve_peak_flops(None, "trn2.48xlarge", torch.bfloat16, 128, 1) == pytest.approx(16 * 667 * T)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.raises(ConfigError, match=r"NEURON_LOGICAL_NC_CONFIG=2.*AWS Trainium: one of \[1\]"):
        datasheet_peak_flops("trn1.32xlarge", torch.bfloat16)


@pytest.mark.parametrize("runtime_name", ["NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB", "cpu", "neuron"])
def test_chips_the_table_lacks_have_no_peak(runtime_name):
    assert datasheet_peak_flops(runtime_name, torch.bfloat16) is None


class NamedCpuBackend(SingleDeviceBackend):
    """The CPU, reporting another chip's name: how the trainer reacts to a device it may not know."""

    def __init__(self, name: str):
        super().__init__(torch.device("cpu"))
        self.name = name

    @property
    def device_name(self) -> str:
        return self.name


def _fit(tmp_path, data_cache, backend=None, *overrides):
    config = load_experiment_config(
        [
            "experiment=debug",
            f"run_dir={tmp_path / 'run'}",
            f"data.cache_dir={data_cache}",
            "trainer.progress_bar=false",
            "trainer.device=cpu",  # MFU against the CPU's measured peak, not a GPU's datasheet
            "trainer.max_steps=3",
            "trainer.log_every=1",
            "trainer.eval_every=3",
            "trainer.checkpoint_every=3",
            *overrides,
        ]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Trainer(config, backend=backend).fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return result, [r for r in records if "train/loss" in r], [str(w.message) for w in caught]


def test_an_unknown_chip_warns_once_and_trains_without_mfu(tmp_path, data_cache):
    result, train, messages = _fit(tmp_path, data_cache, NamedCpuBackend("Imaginary NPU 9000"))
    assert result.step == 3 and len(train) == 3
    assert all("train/mfu" not in r and r["train/tokens_per_s"] > 0 for r in train)
    about_peak = [m for m in messages if "peak FLOP/s" in m]
    assert len(about_peak) == 1 and "Imaginary NPU 9000" in about_peak[0] and "trainer.peak_flops" in about_peak[0]


@pytest.mark.parametrize(("precision", "peak"), [("fp32", 66.9 * T), ("bf16", 989.4 * T)])
def test_a_known_chip_uses_its_datasheet_peak_for_the_precision(tmp_path, data_cache, precision, peak):
    _, train, _ = _fit(tmp_path, data_cache, NamedCpuBackend("NVIDIA H100 80GB HBM3"), f"trainer.precision={precision}")
    config = load_experiment_config(["experiment=debug"])
    flops_per_token = model_flops_per_token(config.model, config.data.seq_len)
    for record in train:
        assert record["train/mfu"] == pytest.approx(record["train/tokens_per_s"] * flops_per_token / peak)


def test_a_configured_peak_wins_over_the_table(tmp_path, data_cache):
    _, default, _ = _fit(tmp_path / "a", data_cache, NamedCpuBackend("NVIDIA H100 80GB HBM3"))
    _, configured, _ = _fit(
        tmp_path / "b", data_cache, NamedCpuBackend("NVIDIA H100 80GB HBM3"), "trainer.peak_flops=1e12"
    )
    ratio = [
        (c["train/mfu"] / c["train/tokens_per_s"]) / (d["train/mfu"] / d["train/tokens_per_s"])
        for c, d in zip(configured, default)
    ]
    assert ratio == pytest.approx([66.9] * 3)


def test_the_cpu_peak_is_measured_by_default(tmp_path, data_cache):
    _, train, messages = _fit(tmp_path, data_cache)
    assert all(0 < r["train/mfu"] < 1.5 for r in train)
    assert not [m for m in messages if "peak FLOP/s" in m]


def test_a_cpu_peak_is_measured_once_per_machine_dtype_and_thread_count(monkeypatch, tmp_path):
    """Measuring takes ~0.8 CPU-seconds, so it is kept in axtorch's cache: a later process (each
    torchrun worker) reads it; the devices one process drives (XLA's virtual CPU devices) share it."""
    measured = []

    def measure(device, dtype):
        measured.append((dtype, torch.get_num_threads()))
        return 1e11

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(peak_flops_module, "measure_matmul_peak_flops", measure)
    monkeypatch.setattr(peak_flops_module, "_MEASURED_CPU_PEAKS", {})
    threads = torch.get_num_threads()
    assert resolve_peak_flops(None, "cpu", torch.float32, num_devices=1, devices_per_process=1) == 1e11
    assert resolve_peak_flops(None, "cpu", torch.float32, num_devices=4, devices_per_process=2) == 2e11
    resolve_peak_flops(None, "cpu", torch.bfloat16, num_devices=1, devices_per_process=1)
    torch.set_num_threads(threads + 1)
    try:
        resolve_peak_flops(None, "cpu", torch.float32, num_devices=1, devices_per_process=1)
    finally:
        torch.set_num_threads(threads)
    assert measured == [(torch.float32, threads), (torch.bfloat16, threads), (torch.float32, threads + 1)]

    # Another process on this machine (this one's own figures forgotten): the file answers.
    monkeypatch.setattr(peak_flops_module, "_MEASURED_CPU_PEAKS", {})
    assert resolve_peak_flops(None, "cpu", torch.float32, num_devices=1, devices_per_process=1) == 1e11
    assert len(measured) == 3
    kept = json.loads((tmp_path / "axtorch" / peak_flops_module.PEAK_CACHE_FILE).read_text())
    assert len(kept) == 3 and all(torch.__version__ in key for key in kept)

    # Another CPU (its model and features), or a file that is not a cache's: measured again.
    monkeypatch.setattr(peak_flops_module, "_MEASURED_CPU_PEAKS", {})
    monkeypatch.setattr(peak_flops_module, "cpu_identity", lambda: "model name : another CPU")
    resolve_peak_flops(None, "cpu", torch.float32, num_devices=1, devices_per_process=1)
    (tmp_path / "axtorch" / peak_flops_module.PEAK_CACHE_FILE).write_text("[not a cache")
    monkeypatch.setattr(peak_flops_module, "_MEASURED_CPU_PEAKS", {})
    resolve_peak_flops(None, "cpu", torch.float32, num_devices=1, devices_per_process=1)
    assert len(measured) == 5


def test_trainers_starting_together_measure_in_turn_and_keep_every_peak(monkeypatch, tmp_path):
    """torchrun's workers start at once: one measures alone while the others wait, then they read
    what it kept. Without the lock each measured beside the others (a peak of shared cores), and
    the last to write dropped the entries written since it read the file."""
    spans: dict[torch.dtype, tuple[float, float]] = {}
    first_measuring = threading.Event()

    def measure(device, dtype):
        start = time.monotonic()
        if dtype == torch.float32:
            first_measuring.set()
            time.sleep(0.5)  # long enough for the other call to end, were it not held
        spans[dtype] = (start, time.monotonic())
        return {torch.float32: 1e11, torch.bfloat16: 2e11}[dtype]

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(peak_flops_module, "measure_matmul_peak_flops", measure)
    monkeypatch.setattr(peak_flops_module, "_MEASURED_CPU_PEAKS", {})
    first = threading.Thread(target=cpu_peak_flops, args=(torch.float32,))
    first.start()
    assert first_measuring.wait(timeout=30)
    assert cpu_peak_flops(torch.bfloat16) == 2e11
    first.join()
    assert spans[torch.bfloat16][0] >= spans[torch.float32][1], spans
    kept = json.loads((tmp_path / "axtorch" / peak_flops_module.PEAK_CACHE_FILE).read_text())
    assert sorted(kept.values()) == [1e11, 2e11]


def test_failing_tensorboard_plot_and_metrics_warn_and_training_goes_on(tmp_path, data_cache, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", broken)
    monkeypatch.setattr(curves_module, "plot_runs", broken)
    monkeypatch.setattr(peak_flops_module, "measure_matmul_peak_flops", broken)
    monkeypatch.setattr(peak_flops_module, "_MEASURED_CPU_PEAKS", {})  # not one an earlier test measured
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nor one kept on this machine
    result, train, messages = _fit(tmp_path, data_cache)
    assert result.step == 3 and result.final_eval_loss is not None
    assert [r["step"] for r in train] == [1, 2, 3]  # the JSONL record is complete without TensorBoard or MFU
    assert sum("TensorBoard logging failed" in m for m in messages) == 1
    assert any("plotting loss.png failed" in m for m in messages)
    assert any("peak FLOP/s failed" in m for m in messages)
    assert (tmp_path / "run" / "checkpoints" / "step_00000003").is_dir()
