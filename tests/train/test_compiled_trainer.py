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
from axtorch.train.compile import compile_choice, compile_layers
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
    # The first step's compile and step 3's are compile time, not productive (evaluation's own are
    # eval's). Step 3's may be quick (inductor's cache can hold its kernels from an earlier run),
    # but it is counted in full: a tenth of a second of rounding in the line aside.
    record = json.loads((tmp_path / "run" / "goodput.jsonl").read_text().splitlines()[-1])["seconds"]
    recompiled = float(said.group(1))
    assert recompiled > 0 and record["compile"] > recompiled - 0.05 and record["compile"] > record["productive"]


def test_the_compiled_head_gives_the_losses_and_gradients_of_whole_logits():
    """The fused head's chunks compiled (what CUDA runs), a short last chunk and the z-loss included."""
    from test_loss import _losses_and_grads

    expected, expected_grads = _losses_and_grads(None, z_loss_weight=1e-2, bias=True, tied=False)
    got, grads = _losses_and_grads(7, z_loss_weight=1e-2, bias=True, tied=False, compiled_head=True)
    for name in ("loss", "cross_entropy", "z_loss"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=1e-6, atol=1e-7)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_compile_line_says_where_the_head_compiles():
    config = load_experiment_config(["experiment=debug", "trainer.compile=true"])
    on_cpu, on_cuda = compile_choice(config, torch.device("cpu")), compile_choice(config, torch.device("cuda"))
    assert not on_cpu.head and "the fused head's chunks run eagerly on cpu" in on_cpu.reason
    assert on_cuda.head and "the fused head's chunks compile too" in on_cuda.reason


@pytest.mark.parametrize("capacity, said", [("null", True), ("1.25", False)])
def test_a_dropless_mixture_says_its_experts_run_eagerly(capacity, said):
    config = load_experiment_config(["experiment=debug", "model=mixtral_tiny"])
    config.model.decoder.layer.feed_forward.capacity_factor = None if capacity == "null" else float(capacity)
    lines = compile_layers(config.model.build())
    layers = config.model.decoder.num_layers
    expected = [
        "the dropless mixture of experts runs its experts eagerly (each expert's rows are a count the router "
        "chooses at run time); a capacity (model.decoder.layer.feed_forward.capacity_factor) compiles them "
        f"({layers} layer(s))"
    ]
    assert lines == (expected if said else [])


def test_compile_with_the_xla_backend_is_refused_by_name(tmp_path, data_cache):
    with pytest.raises(ConfigError, match=r"trainer.compile=True.*torch_xla.*allowed: false or null"):
        load_experiment_config(quiet_debug_run(tmp_path, data_cache, "backend=xla", "trainer.compile=true"))


def _bytes_saved_for_backward(compiled: bool, *overrides: str) -> int:
    """Bytes of the distinct storages autograd keeps from a step's forward for its backward (the second step's)."""
    from axtorch.train.loss import forward_with_loss

    torch.manual_seed(0)
    config = load_experiment_config(["experiment=debug", "model=llama_tiny", *overrides])
    model = config.model.build()
    model.init_weights()
    if compiled:
        compile_layers(model)
    ids = torch.randint(0, config.model.vocab_size, (2, 128))
    storages: dict[int, int] = {}

    def keep(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    for _ in range(2):
        storages.clear()  # the second step's
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            loss, _ = forward_with_loss(model, config.loss.build(), ids, ids)
        loss.loss.backward()
    return sum(storages.values())


@pytest.mark.parametrize("remat", ["none", "full"])
def test_compiled_layers_keep_no_more_for_the_backward_than_eager_ones(remat):
    """What the dry run's docs claim: it traces the eager step, an upper bound of the compiled one's activations."""
    eager = _bytes_saved_for_backward(False, f"model/remat={remat}")
    compiled = _bytes_saved_for_backward(True, f"model/remat={remat}")
    assert compiled <= eager, (compiled, eager)
    if remat == "none":  # inductor recomputes cheap pointwise results rather than keeping them
        assert compiled < 0.9 * eager, (compiled, eager)
