"""The xla backend's dry run (``dry_run=true backend=xla``): the real step traced lazily at the real
size for the mesh's devices (on a one-device runtime it sets up itself), never run, its shardings
held to the rules."""

import os
import subprocess

import pytest
import torch
from xla_runs import ROOT, XLA_PYTHON, needs_xla

from axtorch.plan import load_plan_inputs
from axtorch.train.exit_codes import ExitCode

pytestmark = [needs_xla, pytest.mark.journey]


def _dry_run(*overrides: str) -> subprocess.CompletedProcess:
    """As a user runs it: no XLA device settings in the environment, the dry run makes its own."""
    env = {key: value for key, value in os.environ.items() if key not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    command = [str(XLA_PYTHON), "-m", "axtorch.train", "dry_run=true", "backend=xla", *overrides]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=env | {"TF_CPP_MIN_LOG_LEVEL": "2"}, cwd=ROOT
    )


def test_an_8b_model_on_64_devices_is_traced_whole_and_split_as_its_rules_ask():
    """32 layers of 8B weights that no device holds: every weight a sixty-fourth, AdamW's two moments
    alike, each layer's hidden states split by rows."""
    overrides = ["model=llama3_8b", "mesh.fsdp=64", "sharding=fsdp", "trainer.batch_size=64", "data.seq_len=4096"]
    result = _dry_run(*overrides)
    assert result.returncode == ExitCode.FINISHED, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert "dry run (xla): one step traced by torch_xla for 64 devices (mesh fsdp=64)" in out
    config, _ = load_plan_inputs(overrides)
    with torch.device("meta"):
        model = config.model.build()
    split = sum(p.numel() * 4 // 64 for p in model.parameters() if p.dim() == 2)
    whole = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 1)  # norms, replicated by the rules
    assert f"{len(list(model.parameters()))} in the program, {(split + whole) / 2**30:.3f} GiB a device" in out
    assert f"AdamW moments:  {2 * len(list(model.parameters()))}," in out
    assert "decoder.layers.N output.hidden_states [64, 4096, 4096] split 64x1x1 (32 modules)" in out
    assert "every parameter, moment and annotated activation is split as the rules ask" in out


def test_a_big_parameter_no_rule_covers_and_an_uneven_activation_split_fail_by_name(tmp_path):
    """``require_full_coverage=false`` replicates what no rule covers: a 2 MiB embedding on every
    device is reported; a sequence of 66 split 4 ways would be padded by the compiler."""
    (tmp_path / "sharding").mkdir()
    (tmp_path / "sharding" / "partial.yaml").write_text(
        "require_full_coverage: false\n"
        "parameters:\n"
        "  - pattern: 'lm_head\\.weight|decoder\\.layers\\.\\d+\\.(attention|feed_forward)\\.\\w+_proj\\.weight'\n"
        "    spec: [fsdp, null]\n"
        "activations:\n"
        "  - module: 'decoder\\.layers\\.\\d+'\n"
        "    field: hidden_states\n"
        "    spec: [null, fsdp, null]\n"
    )
    result = _dry_run(
        "--config-dir",
        str(tmp_path),
        "experiment=debug",
        "mesh.fsdp=4",
        "sharding=partial",
        "model.vocab_size=8192",
        "data.seq_len=66",
    )
    assert result.returncode == ExitCode.MISSHARDED, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert "parameter embedding.weight [8192, 64]: no rule covers it, so every device holds it whole (2.0 MiB)" in out
    uneven = "it does not split evenly (dim 1 of size 66 over 4): the compiler pads every device's piece"
    # One line for both layers' outputs, naming the fix.
    assert f"activation decoder.layers.N output.hidden_states [8, 66, 64] (2 modules): {uneven}; " in out
    assert out.count("data.seq_len=68 would") == 1
    assert "decoder.layers.0.attention_norm" not in out  # small, uncovered, replicated: allowed


def test_a_pod_of_128_devices_or_more_traces_and_splits_as_its_rules_ask():
    """torch's autograd engine fails an internal assert on 128 XLA devices or more (its device index
    is 8 bits): the dry run traces for them on a one-device runtime, so the user sees the report."""
    overrides = ["model=llama3_8b", "mesh.fsdp=16", "mesh.model=8", "sharding=fsdp_tp", "trainer.batch_size=16"]
    result = _dry_run(*overrides)
    assert result.returncode == ExitCode.FINISHED, result.stdout + result.stderr[-3000:]
    assert "for 128 devices (mesh fsdp=16 model=8)" in result.stdout
    assert "every parameter, moment and annotated activation is split as the rules ask" in result.stdout
    assert "INTERNAL ASSERT" not in result.stderr
    # A batch of 16 rows over fsdp=128's devices: one line for the rule's 64 activations, naming the fix.
    rows = _dry_run("model=llama3_8b", "mesh.fsdp=128", "sharding=fsdp", "trainer.batch_size=16")
    assert rows.returncode == ExitCode.MISSHARDED, rows.stdout + rows.stderr[-3000:]
    uneven = [line for line in rows.stdout.splitlines() if "does not split evenly" in line]
    assert len(uneven) == 2, rows.stdout  # layers' inputs and outputs
    for line in uneven:
        assert "(32 modules): it does not split evenly (dim 0 of size 16 over 128)" in line
        assert "128 rows a micro-batch would (trainer.batch_size = 128 x trainer.grad_accum_steps)" in line


SECOND_DRY_RUN = """
import torch, torch_xla
from axtorch.parallel.xla import local_shard_shapes, program_split
from axtorch.plan import load_plan_inputs
from axtorch.train.xla_dry_run import xla_dry_run

first = xla_dry_run(*load_plan_inputs(["experiment=debug", "backend=xla", "mesh.fsdp=4", "sharding=fsdp"]))
second = xla_dry_run(*load_plan_inputs(["experiment=debug", "backend=xla", "mesh.fsdp=8", "sharding=fsdp"]))
for report in (first, second):
    assert not report.problems, report.problems
    head = next(t for t in report.tensors if t.name == "lm_head.weight")
    print(report.devices, head.traced, head.device_bytes)
plain = torch.zeros(8, 4, device=torch_xla.device())  # no annotation: every device holds it whole
assert program_split(plain) is None, program_split(plain)
assert local_shard_shapes(plain) == [(8, 4)], local_shard_shapes(plain)
"""


def test_a_second_dry_run_in_one_process_traces_for_its_own_devices():
    """A library caller's dry runs do not depend on the devices the runtime started with: a
    second one in the same process, for another device count, splits as its own mesh says."""
    env = {key: value for key, value in os.environ.items() if key not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    result = subprocess.run(
        [str(XLA_PYTHON), "-c", SECOND_DRY_RUN],
        capture_output=True,
        text=True,
        timeout=600,
        env=env | {"TF_CPP_MIN_LOG_LEVEL": "2"},
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()[-2:]
    head_bytes = 512 * 64 * 4  # the debug model's lm_head, float32
    assert lines == [f"4 (4, 1) {head_bytes // 4}", f"8 (8, 1) {head_bytes // 8}"], result.stdout
