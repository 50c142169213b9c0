"""MFU's denominator: datasheet peaks by chip name, a measured CPU peak, no MFU (never a crash) for an unknown chip."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from axtorch.compose.experiment import load_experiment_config
from axtorch.parallel.single import SingleDeviceBackend
from axtorch.train import peak_flops as peak_flops_module
from axtorch.train import trainer as trainer_module
from axtorch.train.flops import mfu
from axtorch.train.peak_flops import datasheet_peak_flops, find_chip
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
        ("trn1.32xlarge", "AWS Trainium", 190 * T, 47.5 * T),
        ("trn2.48xlarge", "AWS Trainium2", 667 * T, 181 * T),
    ],
)
def test_runtime_names_find_their_datasheet_peaks(runtime_name, chip, bf16, fp32):
    assert find_chip(runtime_name).chip == chip
    assert datasheet_peak_flops(runtime_name, torch.bfloat16) == pytest.approx(bf16)
    assert datasheet_peak_flops(runtime_name, torch.float32) == pytest.approx(fp32)


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


def test_a_known_chip_uses_its_datasheet_peak(tmp_path, data_cache):
    _, train, _ = _fit(tmp_path, data_cache, NamedCpuBackend("NVIDIA H100 80GB HBM3"))
    trainer_flops = None
    for record in train:
        if trainer_flops is None:  # recover flops/token from one record, then check every record agrees
            trainer_flops = record["train/mfu"] * 66.9 * T / record["train/tokens_per_s"]
        assert record["train/mfu"] == pytest.approx(mfu(record["train/tokens_per_s"], trainer_flops, 66.9 * T))


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


def test_failing_tensorboard_plot_and_metrics_warn_and_training_goes_on(tmp_path, data_cache, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", broken)
    monkeypatch.setattr(trainer_module, "plot_runs", broken)
    monkeypatch.setattr(peak_flops_module, "measure_matmul_peak_flops", broken)
    result, train, messages = _fit(tmp_path, data_cache)
    assert result.step == 3 and result.final_eval_loss is not None
    assert [r["step"] for r in train] == [1, 2, 3]  # the JSONL record is complete without TensorBoard or MFU
    assert sum("TensorBoard logging failed" in m for m in messages) == 1
    assert any("plotting loss.png failed" in m for m in messages)
    assert any("peak FLOP/s failed" in m for m in messages)
    assert (tmp_path / "run" / "checkpoints" / "step_00000003").is_dir()
