"""Float8 training (``model/float8``, torchao): which linears convert, how far the loss moves, clear refusals."""

import copy
import dataclasses
import sys

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.models.float8 import RowwiseFloat8Config, TensorwiseFloat8Config
from axtorch.train.checkpoint import read_model_tensors
from axtorch.train.metrics import read_metrics
from axtorch.train.trainer import Trainer, build_model

pytest.importorskip("torchao.float8")

#: Loss difference from fp32 that five float8 steps on the debug model stay within (measured: 1.3e-3
#: tensorwise, 1.7e-3 rowwise; e4m3 keeps 3 mantissa bits).
FLOAT8_LOSS_TOLERANCE = 5e-3
ROWWISE_ON_CPU = torch.__version__ >= "2.10"  # TorchVersion: compares as versions


def _train(tmp_path, name, *extra):
    overrides = [
        "experiment=debug",
        f"run_dir={tmp_path / name}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.progress_bar=false",
        "trainer.device=cpu",  # compared with models built on the CPU
        "trainer.log_every=1",
        "trainer.max_steps=5",
        "trainer.eval_every=100",
        "trainer.checkpoint_every=100",
        *extra,
    ]
    trainer = Trainer(load_experiment_config(overrides))
    trainer.fit()
    return trainer, [m["train/loss"] for m in read_metrics(tmp_path / name / "metrics.jsonl") if "train/loss" in m]


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("fp32"), "fp32")[1]


def test_the_decoder_linears_convert_and_keep_their_parameter_names():
    from torchao.float8.float8_linear import Float8Linear

    config = load_experiment_config(["experiment=debug"])
    model = build_model(config, torch.device("cpu"))
    names = dict(model.state_dict())
    converted = TensorwiseFloat8Config().build(torch.device("cpu")).apply(model)
    assert len(converted) == 2 * 7  # q, k, v, o and the three feed-forward projections of 2 layers
    assert all(isinstance(model.get_submodule(name), Float8Linear) for name in converted)
    assert "lm_head" not in converted  # skipped by default
    assert model.state_dict().keys() == names.keys()  # checkpoints and HF export see the same tensors
    for key, value in model.state_dict().items():
        assert value is names[key] or torch.equal(value, names[key])


def test_linears_that_float8_matmuls_cannot_take_stay_as_they_are():
    config = load_experiment_config(["experiment=debug", "model.decoder.layer.feed_forward.hidden_dim=120"])
    model = build_model(config, torch.device("cpu"))
    converted = TensorwiseFloat8Config().build(torch.device("cpu")).apply(model)
    assert not any("feed_forward" in name for name in converted)  # 120 is not a multiple of 16
    assert len(converted) == 2 * 4


RECIPES = [
    "tensorwise",
    pytest.param("rowwise", marks=pytest.mark.skipif(not ROWWISE_ON_CPU, reason="CPU rowwise needs torch >= 2.10")),
]


def test_on_a_cpu_tensorwise_linears_emulate_torchs_float8_matmul_exactly():
    """Emulated (torch's CPU ``_scaled_mm`` is a reference kernel, ~1000x slower than float32 at the
    debug model's sizes), with the outputs and gradients of torch's kernel; on a CPU whether or not
    the machine has a GPU."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    model = build_model(load_experiment_config(["experiment=debug"]), torch.device("cpu"))
    TensorwiseFloat8Config().build(torch.device("cpu")).apply(model)
    assert model.decoder.layers[0].attention.q_proj.config.emulate
    torch.manual_seed(0)
    linear, inputs, upstream = torch.nn.Linear(32, 48, bias=False), torch.randn(16, 32), torch.randn(16, 48)
    results = []
    for emulate in (False, True):
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=emulate)
        float8 = Float8Linear.from_float(copy.deepcopy(linear), config=config)
        x = inputs.clone().requires_grad_()
        out = float8(x)
        out.backward(upstream)
        results.append((out, x.grad, float8.weight.grad))
    for kernel, emulated in zip(*results):
        torch.testing.assert_close(emulated, kernel, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_training_starts_from_the_same_weights_and_stays_near_fp32(tmp_path, fp32_losses, recipe):
    fp32 = fp32_losses
    trainer, float8 = _train(tmp_path, recipe, f"model/float8={recipe}")
    assert type(trainer.model.decoder.layers[0].attention.q_proj).__name__ == "Float8Linear"
    assert len(float8) == len(fp32) == 5
    assert float8 != fp32  # the matmuls really ran in float8
    torch.testing.assert_close(torch.tensor(float8), torch.tensor(fp32), rtol=0, atol=FLOAT8_LOSS_TOLERANCE)


@pytest.mark.slow
def test_lora_on_a_float8_base_trains_near_its_fp32_counterpart(tmp_path):
    """The frozen base's linears run in float8, their adapters in fp32; only the adapters change and are saved."""
    lora = ("model/adapter=lora", "model.adapter.target=_proj", "optim.lr=0.01")  # every projection
    fp32 = _train(tmp_path, "fp32", *lora)[1]
    trainer, float8 = _train(tmp_path, "float8", *lora, "model/float8=tensorwise", "trainer.checkpoint_every=5")
    q_proj = trainer.model.decoder.layers[0].attention.q_proj
    assert type(q_proj).__name__ == "Float8Linear" and q_proj.adapter.lora_a.dtype == torch.float32
    assert float8 != fp32  # the base's matmuls really ran in float8
    assert float8[-1] < float8[0] - 0.01  # and the adapters learn (measured 6.2501 -> 6.2354, fp32 6.2356)
    torch.testing.assert_close(torch.tensor(float8), torch.tensor(fp32), rtol=0, atol=FLOAT8_LOSS_TOLERANCE)
    plain = build_model(load_experiment_config(["experiment=debug"]), torch.device("cpu"))
    for name, value in plain.named_parameters():  # the base is the seeded one, untouched
        assert torch.equal(trainer.model.get_parameter(name), value), name
    saved = read_model_tensors(tmp_path / "float8" / "checkpoints" / "step_00000005")
    assert sorted(saved) == sorted(n for n, p in trainer.model.named_parameters() if ".adapter.lora_" in n)
    assert len(saved) == 2 * 7 * 2  # 2 layers of 7 projections, A and B


@pytest.mark.parametrize(("capability", "emulated"), [((8, 0), True), ((9, 0), False)])
def test_the_gpu_that_trains_decides_float8_emulation(monkeypatch, capability, emulated):
    """An A100 (8.0) has no float8 matmul: tensorwise emulates and rowwise, which cannot, is refused
    by name; an H100 (9.0) runs torch's kernel. The GPU is simulated: only its capability is read."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "the simulated GPU")
    model = build_model(load_experiment_config(["experiment=debug"]), torch.device("cpu"))
    TensorwiseFloat8Config().build(torch.device("cuda")).apply(model)
    assert model.decoder.layers[0].attention.q_proj.config.emulate is emulated
    if emulated:
        refusal = r"'rowwise'.*capability 8\.0\) has no float8 matmul.*tensorwise \(emulated\)"
        with pytest.raises(ConfigError, match=refusal):
            RowwiseFloat8Config().build(torch.device("cuda"))
    else:
        RowwiseFloat8Config().build(torch.device("cuda"))


@pytest.mark.skipif(ROWWISE_ON_CPU, reason="this torch runs rowwise on a CPU")
def test_rowwise_on_a_cpu_torch_without_per_row_scales_is_refused():
    with pytest.raises(ConfigError, match=r"model.float8='rowwise'.*tensorwise on a CPU with torch < 2.10"):
        load_experiment_config(["experiment=debug", "model/float8=rowwise"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["backend=xla"], r"model.float8='tensorwise'.*none with backend=xla"),
        (["backend=native", "mesh.model=2"], r"mesh.model=2.*1 with model.float8"),
    ],
)
def test_float8_with_what_it_does_not_compose_with_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_experiment_config(["experiment=debug", "model/float8=tensorwise", *overrides])


def test_a_missing_torchao_is_a_config_error_naming_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    config = load_experiment_config(["experiment=debug", "model/float8=tensorwise"])
    with pytest.raises(ConfigError, match=r"pip install 'axtorch\[float8\]'"):
        build_model(config, torch.device("cpu"))
