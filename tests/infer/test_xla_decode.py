"""Decoding on an XLA device: the tokens of eager CPU decoding, from a decode step compiled once.

Runs its worker with the interpreter of the torch_xla environment (``$AXTORCH_XLA_PYTHON`` or
``.venv-xla/bin/python``), on the CPU PJRT device.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from axtorch.cli.generate import main as generate_main
from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.train.trainer import Trainer

pytestmark = pytest.mark.journey

ROOT = Path(__file__).resolve().parents[2]
XLA_PYTHON = Path(os.environ.get("AXTORCH_XLA_PYTHON", ROOT / ".venv-xla" / "bin" / "python"))
WORKER = Path(__file__).with_name("xla_decode_worker.py")


def test_xla_decoding_gives_the_cpu_tokens_from_programs_that_do_not_grow_with_the_steps(tmp_path):
    env = {**os.environ, "PJRT_DEVICE": "CPU", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = tmp_path / "report.json"
    result = subprocess.run(
        [str(XLA_PYTHON), str(WORKER), str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["xla"] == report["cpu"]
    assert [row[:24] for row in report["xla_56"]] == report["xla"]
    assert [len(row) for row in report["xla_56"]] == [56, 56, 56]
    # Every decode step is the same program: as many programs for 56 steps as for 40 (a new
    # length is a new cache shape), and none at all for the same length again.
    for_40, for_56, for_40_again = report["compilations"]
    assert for_56 == for_40 and for_40_again == 0


def test_the_generate_command_on_device_xla_prints_the_cpu_text(tmp_path, data_cache, capsys):
    overrides = ["experiment=debug", f"run_dir={tmp_path / 'run'}", f"data.cache_dir={data_cache}"]
    Trainer(load_experiment_config([*overrides, "trainer.max_steps=2", "trainer.progress_bar=false"])).fit()
    arguments = ["-m", "axtorch.generate", f"checkpoint={tmp_path / 'run'}", "prompt=import os", "max_new_tokens=12"]
    env = {**os.environ, "PJRT_DEVICE": "CPU", "TF_CPP_MIN_LOG_LEVEL": "2"}
    cpu = subprocess.run([sys.executable, *arguments, "device=cpu"], capture_output=True, text=True, timeout=300)
    xla = subprocess.run(
        [str(XLA_PYTHON), *arguments, "device=xla"], capture_output=True, text=True, timeout=300, env=env
    )
    assert cpu.returncode == 0 and xla.returncode == 0, cpu.stderr[-2000:] + xla.stderr[-2000:]
    assert xla.stdout == cpu.stdout and cpu.stdout.startswith("import os")
    # Refused while parsing, before torch_xla is imported: checked in this process.
    assert generate_main([*arguments[2:], "device=xla", "sampling.temperature=0.7"]) == 2
    assert "0 (greedy) with device=xla" in capsys.readouterr().err
