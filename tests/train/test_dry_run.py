"""The dry run (``dry_run=true``): the real step on fake tensors and a fake process group, held to
what the shapes say it must hold and send, and its refusals before any tracing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from axtorch.cli.dry_run import run_dry
from axtorch.config.errors import ConfigError
from axtorch.models.transforms import apply_model_transforms
from axtorch.parallel.backend_kind import BackendKind
from axtorch.plan import load_plan_inputs
from axtorch.train.dry_run import dry_run, format_report
from axtorch.train.exit_codes import ExitCode
from axtorch.train.flops import model_flops_per_token
from axtorch.train.trainer import build_model

DEBUG = ["experiment=debug", "backend=native"]


def _parameter_bytes(overrides: list[str]) -> int:
    config, _ = load_plan_inputs(overrides)
    return sum(p.numel() * p.element_size() for p in build_model(config, torch.device("meta")).parameters())


@pytest.fixture(scope="module")
def fsdp4():
    config, mesh = load_plan_inputs([*DEBUG, "mesh.fsdp=4", "sharding=fsdp"])
    return dry_run(config, mesh), _parameter_bytes(DEBUG)


def test_an_fsdp_rank_holds_a_quarter_of_the_weights_and_adams_two_moments(fsdp4):
    report, whole = fsdp4
    held = report.memory_at_peak
    # FSDP pads each parameter's first dimension to a multiple of 4: within a few rows of a quarter.
    assert whole / 4 <= held["parameters"] <= whole / 4 * 1.02, (held, whole)
    assert held["optimizer state"] == pytest.approx(2 * held["parameters"], rel=0.01), held
    assert held["activations"] > 0
    # Twice the batch: the same weights and moments, and a peak higher by at least what the rank's
    # extra rows keep in each layer for the backward: both norms' inputs and outputs, q, k, v and the
    # attention's output, SwiGLU's gate, up and their product (float32, from the shapes).
    rows = load_plan_inputs(DEBUG)[0].trainer.batch_size
    config, mesh = load_plan_inputs([*DEBUG, "mesh.fsdp=4", "sharding=fsdp", f"trainer.batch_size={2 * rows}"])
    doubled = dry_run(config, mesh)
    assert [doubled.memory_at_peak[kind] for kind in ("parameters", "optimizer state")] == [
        held["parameters"],
        held["optimizer state"],
    ]
    model, layer = config.model, config.model.decoder.layer
    kv = model.dim // layer.attention.num_heads * layer.attention.num_kv_heads
    per_token = 6 * model.dim + 2 * kv + 3 * layer.feed_forward.hidden_dim
    tokens = rows // 4 * config.data.seq_len  # the rank's quarter of the added rows
    kept = tokens * model.decoder.num_layers * per_token * 4
    assert doubled.peak_bytes - report.peak_bytes >= kept, (doubled.memory_at_peak, held)


def test_the_optimizer_update_is_counted_at_its_shards_size_not_the_global_shapes():
    """A batch too small to matter, so the peak can fall in the update: AdamW's moments stay twice
    the rank's weights. (torch 2.10 and later propagate DTensor shapes at the global shapes in the
    active fake mode, and the trackers of 2.11 and 2.13 counted them: 3x here on 2.11, 11x on 2.13,
    85 GiB for 8B on 64 ranks.)"""
    config, mesh = load_plan_inputs([*DEBUG, "mesh.fsdp=4", "sharding=fsdp", "trainer.batch_size=4", "data.seq_len=16"])
    held = dry_run(config, mesh).memory_at_peak
    assert held["optimizer state"] == pytest.approx(2 * held["parameters"], rel=0.01), held


def test_an_fsdp_step_gathers_the_weights_twice_and_reduce_scatters_the_gradients_once(fsdp4):
    report, whole = fsdp4
    sent = {c.kind: c for c in report.collectives}
    # All-gathers before the forward and again before the backward; one reduce-scatter of gradients.
    assert sent["all-gather"].bytes == pytest.approx(2 * whole, rel=0.02), sent
    assert sent["reduce-scatter"].bytes == pytest.approx(whole, rel=0.02), sent
    assert sent["all-gather"].count == 2 * sent["reduce-scatter"].count


def test_a_rank_of_four_computes_a_quarter_of_the_one_device_steps_flops(fsdp4):
    report, _ = fsdp4
    config, mesh = load_plan_inputs(DEBUG)
    one_device = dry_run(config, mesh)
    assert report.flops == pytest.approx(one_device.flops / 4, rel=1e-6)
    # Every matmul counted, the fused loss's in-place head gradient and the CPU attention kernels
    # among them: the step's FLOPs are the model's (6 per weight and token, and the attention's).
    tokens = config.trainer.batch_size * config.data.seq_len
    formula = model_flops_per_token(config.model, config.data.seq_len) * tokens
    assert one_device.flops == pytest.approx(formula, rel=0.03)
    said = format_report(report)
    assert "dry run: 4 devices (mesh fsdp=4)" in said and "no data read, no checkpoint written" in said


@pytest.mark.parametrize(
    ("axes", "collective"),
    [(["mesh.model=2", "sharding=fsdp_tp"], "all-reduce"), (["mesh.seq=2", "sharding=fsdp"], "all-gather")],
    ids=["fsdp-x-tensor", "fsdp-x-sequence"],
)
def test_a_rank_of_a_two_axis_mesh_of_four_holds_a_quarter_of_the_weights(axes, collective):
    """Tensor parallelism splits what FSDP then shards; the sequence axis joins FSDP's (as in torchtitan)."""
    config, mesh = load_plan_inputs([*DEBUG, "mesh.fsdp=2", *axes])
    report = dry_run(config, mesh, steps=1)
    whole = _parameter_bytes(DEBUG)
    assert whole / 4 <= report.memory_at_peak["parameters"] <= whole / 4 * 1.1, (report.memory_at_peak, whole)
    assert collective in {c.kind for c in report.collectives}, report.collectives
    axis = axes[0].split(".")[1].split("=")[0]
    assert f"{collective} over {axis} x" in format_report(report)  # named by the mesh axis its group spans
    assert f"dry run: 4 devices (mesh fsdp=2 {axes[0].split('.')[1]})" in format_report(report)


def test_the_gradient_norm_is_one_all_reduce_whatever_the_depth():
    """Not one small all-reduce per parameter (723 over fsdp for 70B on fsdp=32 x model=8): over the
    whole mesh, the step sums its targets, its loss and its squared gradient shards, and no more."""
    counts = []
    for layers in (2, 4):
        overrides = [*DEBUG, "mesh.fsdp=2", "mesh.model=2", "sharding=fsdp_tp", f"model.decoder.num_layers={layers}"]
        report = dry_run(*load_plan_inputs(overrides))
        counts.append({c.axes: c.count for c in report.collectives if c.kind == "all-reduce"})
    assert counts[0]["fsdp+model"] == counts[1]["fsdp+model"] == 3, counts
    assert "fsdp" not in counts[0] and "fsdp" not in counts[1], counts


def test_a_pipeline_is_traced_on_the_first_rank_of_each_stage_which_hands_the_next_its_hidden_states():
    """Each stage's ranks split its weights over fsdp; the hidden states of every micro-batch go
    forward and their gradients back over ``pipe``; together the stages do an fsdp rank's work."""
    layers = ["model.decoder.num_layers=4", "trainer.batch_size=8", "data.seq_len=64"]
    config, mesh = load_plan_inputs([*DEBUG, *layers, "mesh.pipe=2", "mesh.fsdp=2", "sharding=fsdp"])
    report = dry_run(config, mesh)
    assert [(trace.rank, trace.stages) for trace in report.ranks] == [(0, [0]), (2, [1])]
    with torch.device("meta"):
        model = config.model.build()
    whole = sum(p.nbytes for p in model.parameters())
    layer = sum(p.nbytes for name, p in model.named_parameters() if name.startswith("decoder.layers.0."))
    for trace in report.ranks:
        shard = trace.memory_at_peak["optimizer state"] / 2  # AdamW's two moments of this rank's shard
        assert shard == pytest.approx(whole / 4, rel=0.03), trace.memory_at_peak
        # Its stage's two layers stay gathered from a micro-batch's forward to its backward (FSDP
        # units with no root above them keep their weights after the forward, as torchtitan's do).
        gathered = trace.memory_at_peak["parameters"] - shard
        assert 2 * layer * 0.99 <= gathered <= whole / 2, (gathered, layer, whole)
    microbatches, hidden = 4, 1 * 64 * config.model.dim * 4  # 4 rows a replica, one a micro-batch, fp32
    first, last = ({c.kind: c for c in trace.collectives if c.axes == "pipe"} for trace in report.ranks)
    for sends in (first["send"], first["recv"], last["send"], last["recv"]):
        assert (sends.count, sends.bytes) == (microbatches, microbatches * hidden)
    config, mesh = load_plan_inputs([*DEBUG, *layers, "mesh.fsdp=2", "sharding=fsdp"])
    assert sum(trace.flops for trace in report.ranks) == pytest.approx(dry_run(config, mesh).flops, rel=0.02)
    said = format_report(report)
    assert "the first rank of each pipeline stage" in said and "FLOPs per step (rank 2, stage 1)" in said


@pytest.mark.parametrize("mesh_axes", [[], ["mesh.pipe=2"]], ids=["one-device", "pipeline"])
def test_a_lora_step_keeps_adam_state_for_the_adapters_alone(mesh_axes):
    """The frozen base has no gradient for torch's tracker to hook, and the adapters' own weights
    are made on the meta device with the model (under the dry run's fake mode they were not)."""
    config, mesh = load_plan_inputs([*DEBUG, "model/adapter=lora", *mesh_axes])
    report = dry_run(config, mesh)
    with torch.device("meta"):
        model = config.model.build()
    apply_model_transforms(config.model.transforms(), model, torch.device("meta"))
    adapters = sum(p.nbytes for name, p in model.named_parameters() if ".adapter." in name)
    held = sum(trace.memory_at_peak["optimizer state"] for trace in report.ranks)
    assert adapters > 0 and held == pytest.approx(2 * adapters, rel=0.01), (held, adapters)


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["mesh.pipe=2", "pipeline.microbatches=3"], "invalid config pipeline.microbatches=3"),
        (["mesh.fsdp=-1", "devices=6", "mesh.model=4"], "mesh.fsdp=-1"),
        (["hardware=abacus-9000"], "invalid config hardware='abacus-9000'"),
        (["steps=0"], "invalid config steps=0"),
        (["mesh.fsdp=-1"], "invalid config devices"),
        # The debug model's 2 key/value heads cannot split over 4 (the trace failed in a view before).
        (["mesh.model=4", "sharding=fsdp_tp"], "mesh.model=4: tensor parallelism splits attention by whole key/value"),
    ],
    ids=["pipeline-microbatches", "indivisible", "unknown-hardware", "no-steps", "no-device-count", "heads"],
)
def test_what_a_dry_run_cannot_trace_is_refused_before_tracing(overrides, said, capsys):
    code = run_dry(["dry_run=true", *DEBUG, *overrides], [])
    assert code == ExitCode.CONFIG_ERROR
    assert said in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_the_xla_dry_run_without_torch_xla_says_what_to_install(capsys):
    """With torch_xla, ``tests/parallel/test_xla_dry_run.py`` runs it (in processes of their own)."""
    assert run_dry(["dry_run=true", "experiment=debug", "backend=xla", "mesh.fsdp=4"], []) == ExitCode.CONFIG_ERROR
    assert "backend=xla needs torch_xla" in capsys.readouterr().err
    config, mesh = load_plan_inputs([*DEBUG])
    config.backend = BackendKind.xla
    with pytest.raises(ConfigError, match=r"axtorch\.train\.xla_dry_run"):
        dry_run(config, mesh)  # the native trace refuses it by name


def test_a_dry_run_leaves_no_process_group_behind():
    config, mesh = load_plan_inputs([*DEBUG, "mesh.data=2", "mesh.fsdp=2"])
    dry_run(config, mesh, steps=1)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ConfigError, match="steps=0"):
        dry_run(config, mesh, steps=0)


@pytest.mark.journey
def test_a_step_that_would_not_fit_the_hardware_says_so_and_exits_4(tmp_path):
    command = [
        sys.executable,
        "-m",
        "axtorch.train",
        "dry_run=true",
        "model=llama3_1b",
        "backend=native",
        "mesh.fsdp=-1",
        "sharding=fsdp",
        "hardware=gpu-H100-8x1",
        "trainer.batch_size=256",
        "data.seq_len=4096",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == ExitCode.DOES_NOT_FIT, result.stderr[-3000:]
    assert "dry run: 8 devices (mesh fsdp=8)" in result.stdout, result.stdout
    assert "does NOT fit gpu-H100-8x1" in result.stdout and "of 80.00 GiB a device" in result.stdout
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"


TINY_PRESETS = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "model").glob("*_tiny.yaml"))


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_every_familys_step_traces(preset):
    """Each family's own code (learned positions, soft-capping, experts, sliding windows) runs on
    fake tensors: a value read on the host would end the trace (GPT-2's position check did)."""
    config, mesh = load_plan_inputs([f"model={preset}", "backend=native", "trainer.batch_size=2", "data.seq_len=32"])
    report = dry_run(config, mesh)
    assert report.memory_at_peak["parameters"] >= _parameter_bytes([f"model={preset}"]) and report.flops > 0
