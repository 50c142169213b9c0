"""The xla backend on CPU virtual devices (torch_xla SPMD), each run in its own process (``xla_runs``)."""

import math
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from debug_runs import STEPS, assert_weights_match_one_device, debug_overrides, train_losses, train_on_one_device
from forked_ranks import run_ranks
from xla_runs import ROOT, XLA_PYTHON, needs_xla, preempted_checkpoint, run_worker, wait_for_steps, xla_env

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.train.checkpoint import read_index
from axtorch.train.metrics import read_metrics
from axtorch.train.trainer import Trainer

NATIVE_WORKER = Path(__file__).with_name("native_worker.py")

pytestmark = [needs_xla, pytest.mark.journey]


def _xla(devices: int, out: Path, until: int, overrides: list[str]) -> dict:
    return run_worker(devices, out, until, overrides)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("xla")
    cache = data_cache
    train_on_one_device(root / "single", cache)
    reports = {
        "xla1": _xla(1, root / "xla1.json", STEPS, debug_overrides(root / "xla1", cache)),
        "xla_fsdp4": _xla(
            4,
            root / "xla_fsdp4.json",
            STEPS,
            debug_overrides(root / "xla_fsdp4", cache, "mesh.fsdp=4", "sharding=fsdp"),
        ),
        # With every layer recomputed in the backward (torch.utils.checkpoint, unrolled): the
        # same losses, and torch's checkpoint finds the RNG module the backend registers for xla.
        "xla_fsdp2_tp2": _xla(
            4,
            root / "xla_fsdp2_tp2.json",
            STEPS,
            debug_overrides(
                root / "xla_fsdp2_tp2", cache, "mesh.fsdp=2", "mesh.model=2", "sharding=fsdp_tp", "model/remat=full"
            ),
        ),
        # Context parallelism (rows over fsdp, each sequence over seq) with the layers scanned
        # over stacked weights and min-cut remat inside the scanned layer, over 2 accumulated
        # micro-batches (the gradient norm sums each forward's stacked gradients).
        "xla_fsdp2_seq2_scan_remat": _xla(
            4,
            root / "xla_fsdp2_seq2_scan_remat.json",
            STEPS,
            debug_overrides(
                root / "xla_fsdp2_seq2_scan_remat",
                cache,
                "mesh.fsdp=2",
                "mesh.seq=2",
                "sharding=fsdp",
                "execution.layer_runner=scan",
                "model/remat=full",
                "trainer.grad_accum_steps=2",
            ),
        ),
    }
    return root, reports


@pytest.mark.slow
def test_xla_runs_log_mfu_with_default_settings(runs):
    """No ``trainer.peak_flops``: XLA's virtual CPU devices share the host's measured peak."""
    root, _ = runs
    for name in ("xla1", "xla_fsdp4"):
        values = [m["train/mfu"] for m in read_metrics(root / name / "metrics.jsonl") if "train/mfu" in m]
        assert len(values) == STEPS and all(0 < value < 1.5 for value in values), (name, values)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["xla1", "xla_fsdp4", "xla_fsdp2_tp2", "xla_fsdp2_seq2_scan_remat"])
def test_losses_match_a_single_device(runs, name):
    root, reports = runs
    assert reports[name]["step"] == STEPS
    single, xla = train_losses(root / "single"), train_losses(root / name)
    assert len(xla) == STEPS
    torch.testing.assert_close(torch.tensor(xla), torch.tensor(single), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_each_step_runs_its_programs_once_and_later_steps_compile_none(runs):
    """Forward, backward and clipping run as one program before the host reads the loss and the
    gradient norm (a read before it would run, and compile, the forward again), then the update.
    Scanned layers update one layer at a time: one program, compiled once, run per layer, so no
    program grows with depth."""
    _, reports = runs
    unrolled, scanned = reports["xla_fsdp4"]["programs"], reports["xla_fsdp2_seq2_scan_remat"]["programs"]
    assert len(unrolled) == len(scanned) == STEPS
    assert [step["run"] for step in unrolled] == [2] * STEPS
    layers = 2  # the debug model's: forward-backward, the update outside the layers, then each layer's
    assert [step["run"] for step in scanned] == [2 + layers] * STEPS
    assert scanned[0]["compiled"] == 3  # the layers' update compiled once
    # The scanned group is traced (AOTAutograd) once, by the first training step, not by every forward.
    assert [step["scan_traces"] for step in scanned] == [1] + [0] * (STEPS - 1)
    assert [step["scan_traces"] for step in unrolled] == [0] * STEPS
    assert unrolled[0]["compiled"] == 2
    assert all(step["compiled"] == 0 for step in unrolled[1:] + scanned[1:])


@pytest.mark.slow
def test_an_evaluation_compiles_one_program_for_all_its_batches(runs):
    """The held-out sums start as data on the device, so the first batch's program is every
    batch's; a constant in the first batch's alone made a second program to compile."""
    _, reports = runs
    batches = 4  # the debug experiment's trainer.eval_batches
    for name in ("xla1", "xla_fsdp4"):
        first = reports[name]["evaluations"][0]  # programs compiled by each program run: the sums, then each batch
        assert first[-batches:] == [1] + [0] * (batches - 1) and sum(first) == 2, (name, first)


@pytest.mark.slow
def test_fsdp4_devices_hold_a_quarter_of_parameters_and_optimizer_state(runs):
    _, reports = runs
    report = reports["xla_fsdp4"]
    for name, info in report["parameters"].items():
        shards = info["shards"]
        assert len(shards) == 4, name
        if len(info["shape"]) == 2:  # the fsdp preset shards every matrix on dim 0; norms stay whole
            expected = [info["shape"][0] // 4, info["shape"][1]]
            assert all(shape == expected for shape in shards), (name, shards)
            for key, state_shards in report["optimizer"][name].items():
                assert all(shape == expected for shape in state_shards), (name, key, state_shards)
        else:
            assert all(shape == info["shape"] for shape in shards), name


@pytest.mark.slow
def test_context_parallel_devices_hold_a_block_of_rows_and_of_each_sequence(runs):
    _, reports = runs
    assert reports["xla_fsdp2_seq2_scan_remat"]["batch_shards"] == [[4, 32]] * 4  # 8 rows x 64 tokens
    assert reports["xla_fsdp4"]["batch_shards"] == [[2, 64]] * 4


@pytest.mark.slow
def test_xla_checkpoint_resumes_under_native_and_on_one_device(runs, tmp_path, data_cache):
    """XLA fsdp=4 -> native torchrun fsdp=2 (2 processes) -> one device: same losses as never stopping."""
    root, _ = runs
    cache = data_cache
    name = f"step_{STEPS:08d}"
    index = read_index(root / "xla_fsdp4" / "checkpoints" / name)
    assert len(index["decoder.layers.0.attention.q_proj.weight"]["pieces"]) == 4  # one block per device
    assert len(index["decoder.final_norm.weight"]["pieces"]) == 1  # replicated: written once
    assert_weights_match_one_device(
        root / "xla_fsdp4" / "checkpoints" / name, root / "single" / "checkpoints" / name, "xla_fsdp4"
    )

    to_native, to_single = tmp_path / "to_native", tmp_path / "to_single"
    for target in (to_native, to_single):
        shutil.copytree(root / "xla_fsdp4" / "checkpoints", target / "checkpoints")
    run_ranks(
        2,
        str(NATIVE_WORKER),
        str(tmp_path / "native"),
        str(STEPS + 3),
        *debug_overrides(to_native, cache, "backend=native", "mesh.fsdp=2", "sharding=fsdp"),
    )
    Trainer(load_experiment_config(debug_overrides(to_single, cache))).fit()
    Trainer(load_experiment_config(debug_overrides(root / "single", cache))).fit()
    reference = train_losses(root / "single")[-3:]
    assert all(math.isfinite(x) for x in reference)
    torch.testing.assert_close(torch.tensor(train_losses(to_native)), torch.tensor(reference), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(train_losses(to_single)), torch.tensor(reference), rtol=1e-5, atol=1e-5)


#: A small mixtral_tiny with a capacity factor: static shapes, as GSPMD needs to move tokens to experts.
_SMALL_MOE = [
    "model=mixtral_tiny",
    "model.decoder.num_layers=2",
    "model.dim=64",
    "model.decoder.layer.attention.num_heads=4",
    "model.decoder.layer.feed_forward.hidden_dim=64",
    "model.decoder.layer.feed_forward.capacity_factor=2.0",
]


@pytest.mark.slow
def test_expert_parallel_moe_matches_one_device_with_experts_split_over_the_expert_axis(tmp_path, data_cache):
    cache = data_cache
    train_on_one_device(tmp_path / "single", cache, *_SMALL_MOE)
    report = _xla(
        4,
        tmp_path / "ep.json",
        STEPS,
        debug_overrides(tmp_path / "ep", cache, *_SMALL_MOE, "mesh.fsdp=2", "mesh.expert=2", "sharding=fsdp_ep"),
    )
    single, expert_parallel = train_losses(tmp_path / "single"), train_losses(tmp_path / "ep")
    assert len(expert_parallel) == STEPS
    torch.testing.assert_close(torch.tensor(expert_parallel), torch.tensor(single), rtol=1e-5, atol=1e-5)
    experts = {name: entry for name, entry in report["parameters"].items() if ".experts." in name}
    assert len(experts) == 6  # gate, up and down of 2 layers
    for name, entry in experts.items():  # [8 experts, 64, 64]: 4 whole experts and half the rows per device
        assert entry["shards"] == [[4, 32, 64]] * 4, name


@pytest.mark.slow
def test_a_sigterm_under_xla_finishes_the_step_saves_and_exits_resume_me(tmp_path, data_cache):
    """One host, 4 devices (fsdp=4): the signal ends the run at a step boundary with a valid checkpoint."""
    env = xla_env(4)
    run_dir = tmp_path / "run"
    overrides = debug_overrides(run_dir, data_cache, "mesh.fsdp=4", "sharding=fsdp", "trainer.max_steps=500")
    command = [str(XLA_PYTHON), "-m", "axtorch.train", "backend=xla", *overrides]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    wait_for_steps(process, run_dir)
    process.send_signal(signal.SIGTERM)
    preempted_checkpoint(process, run_dir)
