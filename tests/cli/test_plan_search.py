"""The planner: it searches meshes for a cluster, keeps those that fit, and ranks them."""

import pytest

from axtorch.cli.plan import PlanOptions, load_plan_inputs, main, plan, search_report
from axtorch.cli.plan_search import GIB, Planner, cluster_for
from axtorch.config.errors import ConfigError

CASES = {
    "llama3_8b on 8 H100": (["model=llama3_8b"], "gpu-H100-8x1"),
    "llama3_70b on 256 TPU v5p chips": (["model=llama3_70b"], "tpu-v5p-512"),
    "llama3_405b on 2048 H100": (["model=llama3_405b"], "gpu-H100-8x256"),
}


def _planner(overrides, hardware, **kwargs):
    configs = {name: load_plan_inputs([*overrides, f"sharding={name}"])[0] for name in ("fsdp", "fsdp_tp", "fsdp_ep")}
    cluster = cluster_for(hardware)
    shardings = {name: config.sharding for name, config in configs.items()}
    return Planner(configs["fsdp"], shardings, cluster, 8192, cluster.devices, **kwargs), cluster


@pytest.mark.parametrize("case", list(CASES))
def test_the_chosen_mesh_fits_the_memory_axtorch_plan_computes_for_it(case):
    overrides, hardware = CASES[case]
    planner, cluster = _planner(overrides, hardware)
    best, *others = planner.search()
    assert others and all(other.mfu <= best.mfu for other in others)
    # axtorch-plan, run on the best candidate as a user would run it, agrees on the memory.
    mesh = [f"mesh.{axis}={size}" for axis, size in best.mesh.items()]
    config, sizes = load_plan_inputs([*overrides, *mesh, f"sharding={best.sharding}", f"model/remat={best.remat}"])
    assert sizes == best.mesh
    config.pipeline.microbatches = best.microbatches
    rows = cluster.devices // (best.mesh["data"] * best.mesh["fsdp"] * best.mesh["expert"])
    planned = plan(config, sizes, batch_size=rows // best.microbatches, seq_len=8192)
    assert planned.total_bytes == pytest.approx(best.memory_bytes, rel=0.02)
    assert planned.total_bytes <= 0.9 * cluster.memory_bytes
    assert 0 < best.mfu < 1


def test_less_memory_per_device_forces_more_splitting():
    overrides, hardware = CASES["llama3_8b on 8 H100"]
    roomy, _ = _planner(overrides, hardware)
    tight = Planner(roomy.config, roomy.shardings, cluster_for(hardware, 24), 8192, 8)
    assert min(c.memory_bytes for c in tight.search()) <= 0.9 * 24 * GIB
    assert len(tight.search()) < len(roomy.search())
    assert tight.search()[0].remat == "full"  # nothing lighter fits in 24 GiB


def test_tensor_parallel_across_hosts_pays_the_network():
    planner, _ = _planner(["model=llama3_70b"], "gpu-H100-8x4")
    within = planner.score({"pipe": 1, "data": 1, "fsdp": 4, "seq": 1, "expert": 1, "model": 8}, "fsdp_tp", "full")
    across = planner.score({"pipe": 1, "data": 1, "fsdp": 2, "seq": 1, "expert": 1, "model": 16}, "fsdp_tp", "full")
    assert within is not None and across is not None
    assert across.parts["tensor parallel"] > 5 * within.parts["tensor parallel"]


def test_the_command_prints_the_ranking_and_a_mesh_rule(capsys):
    assert main(["model=llama3_8b", "hardware=gpu-H100-8x1", "seq_len=8192", "global_batch=16", "top=3"]) == 0
    out = capsys.readouterr().out
    assert "gpu-H100-8x1: 8 devices, 80 GiB each" in out
    assert out.count("| fsdp") >= 1 and "| 3 |" in out and "| 4 |" not in out
    assert "  - pattern: 'gpu-H100-8x1'\n    overrides: [backend=native, mesh.fsdp=8" in out
    report = search_report(["model=llama3_8b"], PlanOptions(devices=16, device_memory=40.0, seq_len=4096))
    assert report.startswith("gpu-H100-8x2: 16 devices, 40 GiB each")


def test_an_unknown_cluster_is_a_config_error_naming_it(capsys):
    with pytest.raises(ConfigError, match="hardware='gpu-Z9-8x1'"):
        cluster_for("gpu-Z9-8x1")
    assert main(["model=llama3_8b", "hardware=gpu-Z9-8x1"]) == 2
    assert "gpu-Z9-8x1" in capsys.readouterr().err
