"""The planner: it searches meshes for a cluster, keeps those that fit, ranks them, and says so as a mesh rule."""

import re

import pytest

from axtorch.cli.plan import PlanOptions, main, search_report
from axtorch.config.errors import ConfigError
from axtorch.parallel.chips import GIB
from axtorch.plan import Planner, cluster_for, load_plan_inputs, plan
from axtorch.plan.placement import remat_name

CASES = {
    "llama3_8b on 8 H100": (["model=llama3_8b"], "gpu-H100-8x1"),
    # A TPU step holds every weight gathered over fsdp (the TPU compiler's buffer assignment): at
    # 8192 tokens a device, 70B fits no mesh of 256 v5p chips; 8B fits 64.
    "llama3_8b on 64 TPU v5p chips": (["model=llama3_8b"], "tpu-v5p-128"),
    "llama3_405b on 2048 H100 in bf16": (["model=llama3_405b", "trainer.precision=bf16"], "gpu-H100-8x256"),
}
T = 1e12


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
    chosen = [f"backend={best.backend}", *mesh, f"sharding={best.sharding}", f"model/remat={best.remat}"]
    config, sizes = load_plan_inputs([*overrides, *chosen])
    assert sizes == best.mesh
    config.pipeline.microbatches = best.microbatches
    rows = cluster.devices // (best.mesh["data"] * best.mesh["fsdp"] * best.mesh["expert"])
    planned = plan(config, sizes, batch_size=rows // best.microbatches, seq_len=8192)
    assert planned.memory.total_bytes == pytest.approx(best.memory_bytes, rel=0.02)
    assert planned.memory.total_bytes <= 0.9 * cluster.memory_bytes
    assert 0 < best.mfu < 1


@pytest.mark.parametrize(("precision", "value_bytes", "peak"), [("fp32", 4, 66.9 * T), ("bf16", 2, 989.4 * T)])
def test_memory_and_step_time_follow_the_precision(precision, value_bytes, peak):
    """Counted by hand for llama3_8b, fsdp=8 on one H100 host, one 8192-token sequence per device."""
    planner, _ = _planner(["model=llama3_8b", f"trainer.precision={precision}"], "gpu-H100-8x1")
    candidate = planner.score({"pipe": 1, "data": 1, "fsdp": 8, "seq": 1, "expert": 1, "model": 1}, "fsdp", "none")
    assert candidate is not None
    # At the backward's start, 12 bytes of fp32 weights and AdamW moments per parameter, split 8
    # ways (FSDP2 splits the 65 norms of 4096 too; no gradient yet); activations in the compute
    # precision, per token a layer's 6h + 2q + 2kv + 4H + heads + 2 x head_dim (92,448 values) and
    # the model's 4h; the embedding and head FSDP gathers; the fused loss's whole head gradient,
    # and a collective buffer as large as the embedding and head.
    parameters, vocab_by_dim = 8_030_261_248, 128_256 * 4096
    state = 12 * parameters / 8
    per_layer = 6 * 4096 + 2 * 4096 + 2 * 1024 + 4 * 14336 + 32 + 2 * 128
    activations = value_bytes * 8192 * (32 * per_layer + 4 * 4096)
    head = 4 * 2 * vocab_by_dim + 4 * (1 + 2) * vocab_by_dim
    assert candidate.memory_bytes == pytest.approx(state + activations + head, rel=1e-6)
    # Compute runs at 70% of the precision's peak: 8 sequences of 8192 tokens over 8 devices.
    flops = planner.step_time.flops_per_token * 8 * 8192
    assert planner.step_time.peak_flops == pytest.approx(peak)
    assert candidate.parts["compute"] == pytest.approx(flops / (8 * peak) / 0.7)


def test_less_memory_per_device_forces_more_splitting():
    overrides, hardware = CASES["llama3_8b on 8 H100"]
    roomy, _ = _planner(overrides, hardware)
    # In 24 GiB nothing fits: a pipeline's last stage keeps its loss's whole logits of 8192 x 128256.
    tight = Planner(roomy.config, roomy.shardings, cluster_for(hardware, 32), 8192, 8)
    assert min(c.memory_bytes for c in tight.search()) <= 0.9 * 32 * GIB
    assert len(tight.search()) < len(roomy.search())
    assert tight.search()[0].remat == "full"  # nothing lighter fits in 32 GiB


def test_tensor_parallel_across_hosts_pays_the_network():
    planner, _ = _planner(["model=llama3_70b"], "gpu-H100-8x4")
    within = planner.score({"pipe": 1, "data": 1, "fsdp": 4, "seq": 1, "expert": 1, "model": 8}, "fsdp_tp", "full")
    across = planner.score({"pipe": 1, "data": 1, "fsdp": 2, "seq": 1, "expert": 1, "model": 16}, "fsdp_tp", "full")
    assert within is not None and across is not None
    assert across.parts["tensor parallel"] > 5 * within.parts["tensor parallel"]


@pytest.mark.parametrize(
    ("hardware", "devices", "gib", "bf16_tflops", "fast_domain"),
    [
        ("trn2-64x4", 256, 24, 667 / 4, 64),  # 4 trn2.48xlarge: 16 chips of 4 logical NeuronCores (LNC=2)
        ("trn2-lnc1-128x1", 128, 12, 667 / 8, 128),  # LNC=1: each physical NeuronCore a device
        ("trn1-32x2", 64, 16, 190 / 2, 32),  # 2 trn1.32xlarge: 16 chips of 2 NeuronCores
        ("tpu-v5p-512", 256, 95, 459, 256),  # 512 TensorCores, a megacore chip each device
    ],
)
def test_a_cluster_counts_the_devices_its_processes_drive(hardware, devices, gib, bf16_tflops, fast_domain):
    import torch

    cluster = cluster_for(hardware)
    assert cluster.devices == devices
    assert cluster.memory_bytes == pytest.approx(gib * GIB)
    assert cluster.device.peak_flops(torch.bfloat16) == pytest.approx(bf16_tflops * T)
    assert (cluster.device.fast_domain or cluster.devices) == fast_domain


def test_an_lnc_the_chip_lacks_is_a_config_error():
    with pytest.raises(ConfigError, match=r"lnc=4.*AWS Trainium2: one of \[2, 1\]"):
        cluster_for("trn2-lnc4-32x1")
    with pytest.raises(ConfigError, match=r"lnc=2.*AWS Trainium: one of \[1\]"):
        cluster_for("trn1-lnc2-16x1")


@pytest.fixture(scope="module")
def h100_search():
    """One search, printed as ``axtorch-plan`` prints it."""
    options = PlanOptions(hardware="gpu-H100-8x1", seq_len=8192, global_batch=16, top=3, check=False)
    return search_report(["model=llama3_8b"], options)


def test_the_report_ranks_and_states_the_precision_and_peak(h100_search):
    out = h100_search
    assert out.startswith(
        "gpu-H100-8x1: 8 devices (NVIDIA H100 SXM), 80 GiB each; trainer.precision=fp32: 66.9 TFLOP/s peak per device"
    )
    assert out.count("| fsdp") >= 1 and "| 3 |" in out and "| 4 |" not in out
    report = search_report(["model=llama3_8b"], PlanOptions(devices=16, device_memory=40.0, seq_len=4096, check=False))
    assert report.startswith("gpu-H100-8x2: 16 devices (NVIDIA H100 SXM), 40 GiB each")


def test_the_printed_mesh_rule_composes_from_a_config_dir(h100_search, tmp_path, capsys):
    """The rule, pasted into a user's config dir as docs/configuration.md says, selects the mesh it ranked first."""
    rule = h100_search[h100_search.index("rules:") :]
    (tmp_path / "mesh_rules").mkdir()
    (tmp_path / "mesh_rules" / "planned.yaml").write_text(rule + "\n")
    best = re.search(r"^\| 1 \| ([^|]+) \| (\w+) \| (\w+) \|", h100_search, flags=re.MULTILINE)
    assert best is not None
    mesh_text, sharding, remat = best.groups()
    expected_mesh = {"pipe": 1, "data": 1, "fsdp": 1, "seq": 1, "expert": 1, "model": 1}
    expected_mesh |= {axis: int(size) for axis, size in re.findall(r"(\w+)=(\d+)", mesh_text)}
    ruled = ["model=llama3_8b", "mesh_rules=planned", "mesh_rules.hardware=gpu-H100-8x1"]
    config, sizes = load_plan_inputs(ruled, config_dirs=[tmp_path])
    assert config.mesh_rules.selected == "gpu-H100-8x1"
    assert sizes == expected_mesh
    assert (config.backend.value, config.trainer.precision.value) == ("native", "fp32")
    assert remat_name(config.model.decoder.remat) == remat
    assert config.sharding == load_plan_inputs(["model=llama3_8b", f"sharding={sharding}"])[0].sharding
    # The command takes the config dir as axtorch-train does.
    assert main(["--config-dir", str(tmp_path), *ruled, "check=false"]) == 0
    mesh_line = " ".join(f"{axis}={size}" for axis, size in expected_mesh.items())
    assert f"mesh: {mesh_line} (8 devices)" in capsys.readouterr().out


def test_a_sequence_longer_than_the_models_positions_is_refused_before_the_search(capsys):
    assert main(["experiment=debug", "hardware=gpu-H100-8x1", "seq_len=1024"]) == 2
    err = capsys.readouterr().err
    assert "seq_len=1024" in err and "at most model.max_seq_len=256" in err


def test_an_unknown_cluster_is_a_config_error_naming_it(capsys):
    with pytest.raises(ConfigError, match="hardware='gpu-Z9-8x1'"):
        cluster_for("gpu-Z9-8x1")
    assert main(["model=llama3_8b", "hardware=gpu-Z9-8x1"]) == 2
    assert "gpu-Z9-8x1" in capsys.readouterr().err


def test_compiling_candidates_needs_a_tpu_slice():
    assert main(["model=llama_debug", "hardware=gpu-H100-8x1", "compile=2"]) == 2
    assert main(["model=llama_debug", "hardware=tpu-v5p-8", "compile=-1"]) == 2
