"""The planner's step time priced from a dry run's FLOPs and collectives (``StepTimeModel.traced_parts``):
each collective's bytes sent over the slowest link its group's mesh axes cross, FSDP's gathers
overlapping with compute as in the formula's own estimate."""

import pytest

from axtorch.plan import cluster_for, load_plan_inputs
from axtorch.plan.step_time import StepTimeModel
from axtorch.train.dry_run import CollectiveCount

MESH = {"pipe": 1, "data": 1, "fsdp": 4, "seq": 1, "expert": 1, "model": 8}


def test_a_dry_runs_collectives_are_priced_on_the_links_their_mesh_axes_cross():
    config, _ = load_plan_inputs(["model=llama3_8b"])
    cluster = cluster_for("gpu-H100-8x4")  # 8 devices a host: model=8 on the fast links, fsdp across hosts
    model = StepTimeModel(config, {}, cluster, 4096, 32, flops_per_token=1.0, layer_costs=[1])
    fast, network = cluster.device.fast_bandwidth, cluster.device.network_bandwidth
    one_second = model.peak_flops * model.kernel_efficiency
    collectives = [
        CollectiveCount("all-reduce", 10, bytes=8 * 10**9, axes="model", group_size=8),
        CollectiveCount("all-gather", 4, bytes=12 * 10**9, axes="fsdp", group_size=4),
        CollectiveCount("reduce-scatter", 2, bytes=6 * 10**9, axes="fsdp", group_size=4),
        CollectiveCount("all-reduce", 2, bytes=8, axes="fsdp+model", group_size=32),  # scalars, over the world
    ]
    parts = model.traced_parts(MESH, one_second, collectives)
    assert parts["compute"] == pytest.approx(1.0)
    assert parts["tensor parallel"] == pytest.approx(2 * 8e9 * 7 / 8 / fast)  # a ring all-reduce sends 2 (n-1)/n
    fsdp = (12e9 + 6e9) * 3 / 4 / network  # what FSDP sends, hidden behind the compute up to its length
    assert parts["fsdp/data exposed"] == pytest.approx(max(0.0, fsdp - 1.0))
    assert parts["all-reduce over fsdp+model"] == pytest.approx(2 * 8 * 31 / 32 / network)
    assert set(parts) == {"compute", "tensor parallel", "fsdp/data exposed", "all-reduce over fsdp+model"}


def test_sends_count_whole_and_one_device_collectives_not_at_all():
    assert CollectiveCount("send", 3, bytes=100, axes="pipe", group_size=2).sent_bytes == 100
    assert CollectiveCount("all-gather", 3, bytes=100, axes="", group_size=1).sent_bytes == 0
    assert CollectiveCount("all-to-all", 1, bytes=100, axes="expert", group_size=4).sent_bytes == 75


def test_each_kind_of_collective_counts_under_the_parallelism_that_issues_it():
    """Experts' all-to-all, a pipeline's sends, context parallelism's gathers are exposed; HSDP's
    all-reduce over ``data`` overlaps with compute as FSDP's gathers do; one device's are free."""
    config, _ = load_plan_inputs(["model=llama3_8b"])
    cluster = cluster_for("gpu-H100-8x4")
    model = StepTimeModel(config, {}, cluster, 4096, 32, flops_per_token=1.0, layer_costs=[1])
    mesh = {"pipe": 2, "data": 2, "fsdp": 1, "seq": 2, "expert": 2, "model": 1}
    collectives = [
        CollectiveCount("all-to-all", 4, bytes=4 * 10**9, axes="expert", group_size=2),
        CollectiveCount("send", 8, bytes=10**9, axes="pipe", group_size=2),
        CollectiveCount("recv", 8, bytes=10**9, axes="pipe", group_size=2),
        CollectiveCount("all-gather", 2, bytes=2 * 10**9, axes="seq", group_size=2),
        CollectiveCount("all-reduce", 1, bytes=10**9, axes="data", group_size=2),
        CollectiveCount("all-gather", 1, bytes=10**12, axes="", group_size=1),
    ]
    one_second = model.peak_flops * model.kernel_efficiency
    parts = model.traced_parts(mesh, one_second, collectives)
    link = {axis: cluster.bandwidth(mesh, axis) for axis in ("expert", "pipe", "seq", "data")}
    assert parts["expert all-to-all"] == pytest.approx(4e9 / 2 / link["expert"])
    assert parts["pipeline sends"] == pytest.approx(1e9 / link["pipe"])  # a receive sends nothing
    assert parts["context parallel"] == pytest.approx(2e9 / 2 / link["seq"])
    assert parts["fsdp/data exposed"] == pytest.approx(max(0.0, 2 * 1e9 / 2 / link["data"] - 1.0))
    assert set(parts) == {"compute", "expert all-to-all", "pipeline sends", "context parallel", "fsdp/data exposed"}


def test_a_pipelines_traced_step_idles_for_its_bubble_as_the_formulas_does():
    """The busiest stage's traced FLOPs are its compute; the pipeline idles beside them for the
    bubble's share of the step, priced as ``parts`` prices it."""
    config, _ = load_plan_inputs(["model=llama3_8b"])
    model = StepTimeModel(config, {}, cluster_for("gpu-H100-8x4"), 4096, 32, flops_per_token=1.0, layer_costs=[1])
    mesh = {"pipe": 4, "data": 1, "fsdp": 8, "seq": 1, "expert": 1, "model": 1}
    one_second = model.peak_flops * model.kernel_efficiency
    bubble = 3 / (8 + 3)  # 4 stages, 8 micro-batches
    parts = model.traced_parts(mesh, one_second, [], bubble)
    assert parts["pipeline bubble"] == pytest.approx(bubble / (1 - bubble))
    assert sum(parts.values()) == pytest.approx(1 / (1 - bubble))  # the step: compute over the busy share
    assert "pipeline bubble" not in model.traced_parts(mesh, one_second, [])
