"""``trainer.compile``: compiled layers train as eager ones do, compile once, and say when they compile again."""

import json
import re
from pathlib import Path

import pytest
import torch
from forked_ranks import run_ranks
from quiet_runs import quiet_debug_run

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.train.trainer import Trainer

# Inductor builds and loads its kernels in processes of its own.
pytestmark = pytest.mark.journey

WORKER = Path(__file__).with_name("compiled_worker.py")
STEPS = 5
#: LoRA over the frozen base and full remat around each compiled layer: the combination users run.
FEATURES = ("model/adapter=lora", "model/remat=full")


def _compare(tmp_path: Path, data_cache: Path, processes: int, *mesh: str) -> dict:
    out = tmp_path / "report.json"
    overrides = quiet_debug_run(tmp_path / "run", data_cache, "trainer.eval_every=100", *mesh, *FEATURES)
    run_ranks(processes, str(WORKER), str(out), str(STEPS), *overrides)
    report = json.loads(out.read_text())
    assert report["layers_compiled"] == report["layers"] > 0
    # Each layer's forward ran compiled in the steady state.
    assert report["compiled_regions_in_last_step"] >= report["layers"]
    # Within float32 reassociation: the compiled kernels sum in another order.
    torch.testing.assert_close(report["compiled"], report["eager"], rtol=1e-5, atol=1e-6)
    graphs = report["graphs"]
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs[1:] == [graphs[1]] * (STEPS - 1) and graphs[2] == graphs[1], f"compiled again after step 2: {graphs}"
    return report


@pytest.mark.slow
def test_compiled_layers_train_as_eager_ones_do_on_one_device(tmp_path, data_cache):
    _compare(tmp_path, data_cache, 1)


@pytest.mark.slow
def test_compiled_layers_train_as_eager_ones_do_under_fsdp(tmp_path, data_cache):
    _compare(tmp_path, data_cache, 2, "backend=native", "mesh.fsdp=2", "sharding=fsdp")


def test_a_compile_after_the_second_step_is_said_and_counted_as_compile_time(tmp_path, data_cache, capsys):
    overrides = ("trainer.compile=true", "trainer.eval_every=100", "trainer.max_steps=4")
    config = load_experiment_config(quiet_debug_run(tmp_path / "run", data_cache, *overrides))
    trainer = Trainer(config)
    batches = trainer.train_batches

    class ShorterThird:  # a step of other shapes (half the rows) after two: the layers compile again
        def __next__(self):
            batch = next(batches)
            return {k: v[: len(v) // 2] for k, v in batch.items()} if trainer.step == 2 else batch

        def __getattr__(self, name):
            return getattr(batches, name)

    trainer.train_batches = ShorterThird()
    trainer.fit()
    out = capsys.readouterr().out
    assert "compile: on: trainer.compile=true" in out
    said = re.search(r"step 3: torch.compile compiled \d+ more graph\(s\) in ([\d.]+) s .*TORCH_LOGS=recompiles", out)
    assert said, out
    assert "step 4: torch.compile" not in out
    # The first step's compile and step 3's are compile time, not productive (evaluation's own are eval's).
    record = json.loads((tmp_path / "run" / "goodput.jsonl").read_text().splitlines()[-1])
    assert record["seconds"]["compile"] > float(said.group(1)) > 0.5 > record["seconds"]["productive"]


def test_compile_with_the_xla_backend_is_refused_by_name(tmp_path, data_cache):
    with pytest.raises(ConfigError, match=r"trainer.compile=True.*torch_xla.*allowed: false or null"):
        load_experiment_config(quiet_debug_run(tmp_path, data_cache, "backend=xla", "trainer.compile=true"))
