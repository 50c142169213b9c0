"""The xla backend's step compiled by the TPU compiler for a TPU slice, on this CPU host
(``dry_run=true backend=xla hardware=<topology>``), held to what the sharding rules and the
model's shapes say a chip must hold: the compiler's own buffer assignment is the independent side.

The compile runs in the xla environment (torch 2.9.0, torch_xla, jax and libtpu: the ``tpu``
extra), as a user runs it there.
"""

import json
import os
import re
import subprocess

import pytest
import torch
from xla_runs import ROOT, XLA_PYTHON, needs_xla

from axtorch.plan import load_plan_inputs
from axtorch.train.exit_codes import ExitCode

pytestmark = [needs_xla, pytest.mark.journey]

#: A model whose every per-chip piece fills whole TPU tiles (8 x 128 floats), so that layout
#: padding adds nothing: 256 wide, a feed-forward of 512, a vocabulary of 1024, split 4 ways.
SMALL = [
    "experiment=debug",
    "backend=xla",
    "mesh.fsdp=4",
    "model.dim=256",
    "model.decoder.layer.feed_forward.hidden_dim=512",
    "model.vocab_size=1024",
    "trainer.batch_size=32",
    "data.seq_len=128",
]
TOPOLOGY = "v5p:2x2x1"  # 4 chips, one device each

COMPILE = """
import dataclasses, json, sys
from axtorch.compose.registry import register_configs
from axtorch.parallel.chips import tpu_topology
from axtorch.plan import load_plan_inputs
from axtorch.train.xla_dry_run import xla_dry_run

register_configs()
config_dirs = sys.argv[3:4]
report = xla_dry_run(*load_plan_inputs(sys.argv[2].split(), None, config_dirs), tpu_topology(sys.argv[1]))
print(json.dumps(dataclasses.asdict(report.compiled)))
"""


def _env() -> dict[str, str]:
    """As a user's shell: no XLA device settings (the dry run makes its own)."""
    env = {key: value for key, value in os.environ.items() if key not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    return env | {"TF_CPP_MIN_LOG_LEVEL": "2"}


def _compiled(overrides: list[str], config_dir: str = "") -> dict:
    command = [str(XLA_PYTHON), "-c", COMPILE, TOPOLOGY, " ".join(overrides), *([config_dir] if config_dir else [])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _state_bytes(overrides: list[str], split: "callable") -> int:
    """Parameters and AdamW's two moments, per chip, from the model's shapes and a chip's share of each."""
    config, _ = load_plan_inputs(overrides)
    with torch.device("meta"):
        model = config.model.build()
    return sum(3 * p.numel() * p.element_size() // split(name, p) for name, p in model.named_parameters())


def test_the_compiled_step_holds_the_sharded_state_to_the_byte_donates_it_and_gathers_over_fsdp(tmp_path):
    """fsdp=4: every matrix a quarter, the norms whole. The compiler's donated (aliased) bytes are
    exactly that state; its arguments are that plus the batch and a few scalars; every updated
    tensor is a donated argument; the partitioner gathers the weights and reduces their gradients."""
    compiled = _compiled([*SMALL, "sharding=fsdp"])
    state = _state_bytes(SMALL, lambda name, p: 4 if p.dim() == 2 else 1)
    batch = 2 * 32 * 128 * 8 // 4  # input ids and labels, int64, a quarter of the rows each
    assert compiled["alias_bytes"] == state
    assert state + batch <= compiled["argument_bytes"] < state + batch + 64 * 1024  # + scalars (lr, betas, ...)
    config, _ = load_plan_inputs(SMALL)
    with torch.device("meta"):
        updated = 3 * len(list(config.model.build().parameters()))
    assert len(compiled["aliased"]) == updated
    assert sorted(result for result, _ in compiled["aliased"]) == list(range(updated))
    kinds = compiled["collectives"]
    assert kinds["all-gather"]["count"] > 0 and kinds["all-gather"]["bytes"] > 0
    reduced = kinds.get("reduce-scatter", {"bytes": 0})["bytes"] + kinds.get("all-reduce", {"bytes": 0})["bytes"]
    assert reduced > 0
    assert compiled["devices"] == 4 and compiled["flops"] > 0 and compiled["temporary_bytes"] > 0

    # A preset that leaves the feed-forward's matrices to no rule: the compiler holds them whole.
    (tmp_path / "sharding").mkdir()
    (tmp_path / "sharding" / "no_ffn.yaml").write_text(
        "require_full_coverage: false\n"
        "parameters:\n"
        "  - pattern: 'embedding\\.weight|lm_head\\.weight|decoder\\.layers\\.\\d+\\.attention\\.\\w+_proj\\.weight'\n"
        "    spec: [fsdp, null]\n"
    )
    dropped = _compiled([*SMALL, "sharding=no_ffn"], str(tmp_path))
    whole_ffn = _state_bytes(SMALL, lambda name, p: 1 if p.dim() == 1 or "feed_forward" in name else 4)
    assert dropped["alias_bytes"] == whole_ffn > state


def _dry_run(*overrides: str) -> subprocess.CompletedProcess:
    command = [str(XLA_PYTHON), "-m", "axtorch.train", "dry_run=true", "backend=xla", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)


def test_the_command_exits_4_with_the_compilers_words_and_refuses_what_it_cannot_compile_by_name():
    """(The report of a step that fits: the launcher's test below, which runs the same command.)"""
    # Logits of 64 x 4096 tokens over 65536 words, a quarter a chip: more than a v5e's 16 GiB.
    too_big = _dry_run(
        "experiment=debug", "mesh.fsdp=4", "sharding=fsdp", "trainer.batch_size=64", "data.seq_len=4096",
        "model.max_seq_len=4096", "model.vocab_size=65536", "loss.chunk_size=null", "hardware=tpu-v5e-4",
    )  # fmt: skip
    assert too_big.returncode == ExitCode.DOES_NOT_FIT, too_big.stdout + too_big.stderr[-3000:]
    assert "the TPU compiler could not fit the step in a device's memory of v5e:2x2" in too_big.stdout
    assert "Ran out of memory in memory space hbm" in too_big.stdout and "f32[65536,65536]" in too_big.stdout

    mismatched = _dry_run("experiment=debug", "mesh.fsdp=8", "sharding=fsdp", "hardware=v5p:2x2x1")
    assert mismatched.returncode == ExitCode.CONFIG_ERROR
    assert "mesh axes fsdp=8 need 8 devices, found 4" in mismatched.stderr
    unknown = _dry_run("experiment=debug", "mesh.fsdp=4", "hardware=v9z:2x2")
    assert unknown.returncode == ExitCode.CONFIG_ERROR
    assert "invalid config hardware='v9z:2x2'" in unknown.stderr and "v5p:2x2x1 .." in unknown.stderr
    # torch_xla without the compiler: the tpu extra is named.
    without_libtpu = subprocess.run(
        [
            str(XLA_PYTHON),
            "-c",
            "import sys; sys.modules['libtpu'] = None; from axtorch.cli.train import main; main()",
            "dry_run=true",
            "backend=xla",
            "experiment=debug",
            "mesh.fsdp=4",
            "hardware=tpu-v5p-8",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
        cwd=ROOT,
    )
    assert without_libtpu.returncode == ExitCode.CONFIG_ERROR
    assert "pip install 'axtorch[tpu]'" in without_libtpu.stderr
    for refused in (mismatched, unknown, without_libtpu):
        assert "Traceback" not in refused.stderr


def test_the_least_effort_compile_says_it_is_one_and_holds_the_same_state():
    """``compile_effort=-1`` (how a small host compiles a deep unrolled step): the report says which
    effort it compiled at, and what the arguments hold does not depend on it; out of range is refused."""
    overrides = [SMALL[0], *SMALL[2:], "sharding=fsdp", f"hardware={TOPOLOGY}"]  # _dry_run adds the backend
    least = _dry_run(*overrides, "compile_effort=-1")
    assert least.returncode == ExitCode.FINISHED, least.stdout + least.stderr[-3000:]
    assert f"for {TOPOLOGY}: 4 TPU v5 devices, in" in least.stdout
    assert "at optimization effort -1 (0 is the TPU's own compile)" in least.stdout
    default = _dry_run(*overrides)
    assert "optimization effort" not in default.stdout
    held = [
        [line for line in run.stdout.splitlines() if line.strip().startswith("arguments")] for run in (least, default)
    ]
    assert held[0] == held[1] and len(held[0]) == 1
    refused = _dry_run(*overrides, "compile_effort=2")
    assert refused.returncode == ExitCode.CONFIG_ERROR
    assert "invalid config compile_effort=2.0; allowed: a number from -1 (least) to 1 (most)" in refused.stderr


def test_the_layer_scan_compiles_and_holds_the_state_it_stacks():
    """``execution.layer_runner=scan``: one loop over the stacked layers, its 64-bit integers compiled
    as 32-bit ones (what libtpu 0.0.21 needs there, said in the report); the compiler's arguments
    hold at least the split state, and the stacked moments are donated to the outputs."""
    scanned = _dry_run(SMALL[0], *SMALL[2:], "sharding=fsdp", f"hardware={TOPOLOGY}", "execution.layer_runner=scan")
    assert scanned.returncode == ExitCode.FINISHED, scanned.stdout + scanned.stderr[-3000:]
    assert "the layer scan: its loop's FLOPs, bytes and collectives are counted once" in scanned.stdout
    arguments = next(line for line in scanned.stdout.splitlines() if line.strip().startswith("arguments"))
    held, state = re.search(r"arguments\s+([\d.]+) MiB .*from their shapes: ([\d.]+) MiB", arguments).groups()
    assert float(held) >= float(state) > 0
    outputs = next(line for line in scanned.stdout.splitlines() if line.strip().startswith("outputs"))
    assert int(re.search(r"(\d+) updated tensors donated", outputs).group(1)) > 0


def test_the_tpu_launcher_compiles_the_step_first_and_starts_nothing_on_the_pod_when_it_cannot(tmp_path):
    """``CHECK_ON=<slice> launch/tpu_pod.sh ...``: the dry run here, then the pod (a stand-in gcloud
    that records its arguments); a step refused by the check never reaches the pod."""
    gcloud = tmp_path / "bin" / "gcloud"
    gcloud.parent.mkdir()
    gcloud.write_text(f'#!/usr/bin/env bash\necho "$@" > {tmp_path / "gcloud.args"}\n')
    gcloud.chmod(0o755)
    env = _env() | {
        "PATH": f"{gcloud.parent}:{os.environ['PATH']}",
        "TPU_NAME": "my-v5p-8",
        "ZONE": "us-east5-a",
        "CHECK_ON": "tpu-v5p-8",
        "LOCAL_PYTHON": str(XLA_PYTHON),
    }

    def launch(*overrides: str) -> subprocess.CompletedProcess:
        script = str(ROOT / "launch" / "tpu_pod.sh")
        return subprocess.run([script, *overrides], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)

    refused = launch("experiment=debug", "mesh.fsdp=8", "sharding=fsdp")
    assert refused.returncode == 1 and "nothing started" in refused.stderr
    assert not (tmp_path / "gcloud.args").exists()
    started = launch("experiment=debug", "mesh.fsdp=4", "sharding=fsdp")
    assert started.returncode == 0, started.stdout + started.stderr[-3000:]
    out = started.stdout
    assert "compiled by the TPU compiler (libtpu 0.0.21) for v5p:2x2x1: 4 TPU v5 devices" in out
    assert "of 95.00 GiB a device: fits" in out
    assert "collectives the partitioner inserted: all-gather x" in out
    assert "Traceback" not in started.stderr
    pod = (tmp_path / "gcloud.args").read_text()
    assert "tpu-vm ssh my-v5p-8 --zone us-east5-a --worker=all" in pod
    assert "backend=xla experiment=debug mesh.fsdp=4 sharding=fsdp" in pod


def test_the_plans_best_candidates_compiled_and_ranked_by_the_compiler():
    """``axtorch-plan hardware=<TPU slice> compile=2``: the formula's two best, each compiled in a
    process of its own, ranked again by what the compiler says, both rankings printed."""
    command = [
        str(XLA_PYTHON),
        "-m",
        "axtorch.plan",
        "experiment=debug",
        "hardware=tpu-v5p-8",
        "compile=2",
        "check=false",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert "| rank | mesh | sharding | remat |" in out  # the formula's ranking
    assert "the best 2 compiled for v5p:2x2x1 by the TPU compiler, ranked by what it says" in out
    rows = out.split("ranked by what it says")[1].strip().splitlines()[2:]
    assert len(rows) == 2, out
    for row in rows:
        hbm, fits, seconds = row.split()[-4:-1]
        assert float(hbm) > 0 and fits == "yes" and float(seconds) > 0, row
    assert sorted(int(row.split()[1]) for row in rows) == [1, 2]  # the planner's ranks, both there
