"""The dry run held to reality: at sizes this machine runs, its per-rank peak and collectives
equal those of the same steps really run under torchrun (gloo), measured with the same tools on
real tensors and real collectives (``measured_run``)."""

import json
from pathlib import Path

import pytest
from forked_ranks import run_ranks

from axtorch.plan import load_plan_inputs
from axtorch.train.dry_run import dry_run

pytestmark = pytest.mark.journey

WORKER = Path(__file__).with_name("dry_run_worker.py")
#: Big enough that activations, weights and optimizer state all count; small enough for 2 cores.
SIZE = ["experiment=debug", "backend=native", "trainer.device=cpu", "trainer.batch_size=8", "data.seq_len=64"]


@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.fsdp=2", "sharding=fsdp"],
        ["mesh.fsdp=2", "mesh.model=2", "sharding=fsdp_tp"],
        ["model=mixtral_tiny", "mesh.fsdp=2", "mesh.expert=2", "sharding=fsdp_ep"],
        ["mesh.pipe=2", "mesh.fsdp=2", "sharding=fsdp"],
    ],
    ids=["fsdp", "fsdp_x_model", "fsdp_x_expert", "pipe_x_fsdp"],
)
def test_the_dry_runs_peak_and_collectives_are_a_real_runs(tmp_path, mesh):
    overrides = [*SIZE, *mesh]
    config, axes = load_plan_inputs(overrides)
    report = dry_run(config, axes)
    out = tmp_path / "measured.json"
    run_ranks(report.devices, str(WORKER), str(out), *overrides)
    every_rank = json.loads(out.read_text())

    # Rank 0, which stands for all the ranks of its mesh, or the first rank of each pipeline stage.
    assert [traced.rank for traced in report.ranks] == list(range(0, report.devices, report.devices // axes["pipe"]))
    for traced in report.ranks:
        measured = every_rank[traced.rank]
        real_peak = sum(measured["memory_at_peak"].values())
        assert traced.peak_bytes == pytest.approx(real_peak, rel=0.10), (traced.memory_at_peak, measured)
        for kind in ("parameters", "optimizer state"):
            assert traced.memory_at_peak[kind] == pytest.approx(measured["memory_at_peak"][kind], rel=0.10), (
                kind,
                traced.memory_at_peak,
                measured["memory_at_peak"],
            )
        real_collectives = {(c["kind"], c["axes"]): c for c in measured["collectives"]}
        assert {(c.kind, c.axes) for c in traced.collectives} == set(real_collectives)
        for sent in traced.collectives:
            real = real_collectives[sent.kind, sent.axes]
            assert sent.count == real["count"], (sent, real)
            assert sent.bytes == pytest.approx(real["bytes"], rel=0.10), (sent, real)
        assert traced.flops == pytest.approx(measured["flops"], rel=0.10)
