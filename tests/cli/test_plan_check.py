"""``axtorch-plan`` checks its plan with the dry run by default where that takes under a minute,
prints both figures side by side with the command that reproduces the dry run, and says why
where it does not check."""

import re
import shlex

import pytest

from axtorch.cli.plan import PlanOptions, main, search_report
from axtorch.parallel.chips import GIB
from axtorch.plan import load_plan_inputs
from axtorch.train.dry_run import dry_run

DEBUG_FSDP = ["experiment=debug", "backend=native", "mesh.fsdp=2", "sharding=fsdp"]


def _dry_run_peak(out: str) -> float:
    return float(re.search(r"^  peak\s+[\d.]+\s+([\d.]+)$", out, flags=re.MULTILINE).group(1))


def test_the_plan_is_checked_by_default_with_the_command_that_reproduces_it(capsys):
    assert main([*DEBUG_FSDP, "batch=2", "seq_len=32"]) == 0
    out = capsys.readouterr().out
    command = re.search(r"^checked by the dry run \(\d+ s\): (.*)$", out, flags=re.MULTILINE).group(1)
    arguments = shlex.split(command)
    assert arguments[:2] == ["axtorch-train", "dry_run=true"]
    # Two sequences a device on two fsdp replicas: the global batch the trainer takes.
    assert {"trainer.batch_size=4", "data.seq_len=32", *DEBUG_FSDP} <= set(arguments)
    config, mesh = load_plan_inputs([a for a in arguments[2:]])
    assert _dry_run_peak(out) == pytest.approx(dry_run(config, mesh).peak_bytes / GIB, abs=1e-3)
    assert "the planner's peak is" in out


def test_check_false_leaves_it_out(capsys):
    assert main([*DEBUG_FSDP, "check=false"]) == 0
    assert "dry run" not in capsys.readouterr().out


def test_a_model_too_large_to_trace_quickly_says_how_to_check_it(capsys):
    assert main(["model=llama3_70b", "mesh.fsdp=32", "mesh.model=8", "sharding=fsdp_tp"]) == 0
    assert "not checked by the dry run: 80 layers trace in about a minute" in capsys.readouterr().out


def test_the_xla_backend_is_said_and_refused_when_asked_for(capsys):
    xla = [*DEBUG_FSDP[:1], "backend=xla", "mesh.fsdp=2", "sharding=fsdp"]
    assert main(xla) == 0
    assert "not checked by the dry run: the dry run traces the native backend's program" in capsys.readouterr().out
    assert main([*xla, "check=true"]) == 2
    assert "check=True" in capsys.readouterr().err


def test_a_pipeline_plan_is_checked_on_its_fullest_stage_and_prices_it_within_a_tenth(capsys):
    """A wide vocabulary makes the last stage the fullest: its loss keeps whole logits, which the
    planner prices (``STAGE_LOSS_BYTES``) beside the first stage's micro-batches in flight."""
    pipe = ["experiment=debug", "backend=native", "mesh.pipe=2", "mesh.fsdp=2", "sharding=fsdp"]
    assert main([*pipe, "model.decoder.num_layers=4", "model.vocab_size=4096", "batch=2", "seq_len=256"]) == 0
    out = capsys.readouterr().out
    command = re.search(r"^checked by the dry run \(\d+ s\): (.*)$", out, flags=re.MULTILINE).group(1)
    arguments = shlex.split(command)
    # Two sequences a device in each of the plan's 4 micro-batches, on two fsdp replicas.
    assert "trainer.batch_size=16" in arguments
    report = dry_run(*load_plan_inputs(arguments[2:]))
    assert _dry_run_peak(out) == pytest.approx(report.peak_bytes / GIB, abs=1e-3)
    assert f"the dry run's memory is its fullest traced rank's ({report.fullest.name})" in out
    assert report.fullest.stages == [1]
    ratio = float(re.search(r"the planner's peak is ([\d.]+)x the dry run's", out).group(1))
    assert 0.9 <= ratio <= 1.1, out


def test_the_searchs_best_mesh_is_checked():
    options = PlanOptions(hardware="gpu-H100-8x1", seq_len=256, global_batch=64, top=1)
    report = search_report(["experiment=debug"], options)
    best = re.search(r"overrides: \[(.*)\]", report).group(1).split(", ")
    command = re.search(r"^checked by the dry run \(\d+ s\): (.*)$", report, flags=re.MULTILINE).group(1)
    arguments = shlex.split(command)
    assert set(best) - {"trainer.precision=fp32"} <= set(arguments)  # the best mesh, as its rule runs it
    assert {"trainer.batch_size=64", "data.seq_len=256"} <= set(arguments)
    assert _dry_run_peak(report) > 0
    # The step time from the formulas beside the one priced from the traced FLOPs and collectives.
    compute = re.search(r"^  compute +(\S+) +(\S+)$", report, flags=re.MULTILINE)
    assert compute is not None and "step time, seconds" in report, report
    planned, traced = map(float, compute.groups())
    assert planned > 0 and traced == pytest.approx(planned, rel=0.25), report  # FLOPs counted and computed


@pytest.mark.slow
@pytest.mark.parametrize(
    "row",
    [
        ["model=llama3_8b", "mesh.fsdp=64", "sharding=fsdp", "batch=1", "seq_len=256"],
        ["model=llama3_8b", "mesh.fsdp=64", "sharding=fsdp", "batch=1", "seq_len=4096"],
        [
            "model=llama3_70b",
            "mesh.fsdp=32",
            "mesh.model=8",
            "sharding=fsdp_tp",
            "batch=1",
            "seq_len=256",
            "check=true",
        ],
        ["model=mixtral_8x7b", "mesh.fsdp=8", "mesh.expert=8", "sharding=fsdp_ep", "batch=1", "seq_len=256"],
    ],
    ids=["8b-fsdp64-short", "8b-fsdp64-long", "70b-fsdp32xmodel8-short", "mixtral-fsdp8xexpert8-short"],
)
def test_the_planner_prices_large_meshes_within_a_tenth_of_the_dry_run(capsys, row):
    """Short sequences, where the weights' and the head's buffers weigh most, and a long one, where
    activations do; dense, tensor-parallel and a mixture of experts over an expert axis."""
    assert main(["backend=native", *row]) == 0
    out = capsys.readouterr().out
    ratio = float(re.search(r"the planner's peak is ([\d.]+)x the dry run's", out).group(1))
    assert 0.9 <= ratio <= 1.1, out
