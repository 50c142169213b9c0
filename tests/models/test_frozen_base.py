"""An int8 frozen base under LoRA (``model/frozen_base=int8``): exact gradients, a quarter of the bytes, round trip.

The base's decoder linears hold int8 weights with one scale per output channel, dequantised per
call; the gradients are those of a float32 model whose weights are the dequantised ones, only the
adapters are saved, the digest names the original base, and export merges into the dequantised
weights.
"""

import gc
import json
import weakref

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from interop.test_init_from import hf_dir  # noqa: F401 (a fixture: a random HF Llama shaped like llama_debug)

from axtorch.cli.export import main as export_main
from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.interop import from_hf
from axtorch.layers.int8_linear import FrozenInt8Linear, dequantize_per_channel_int8, quantize_per_channel_int8
from axtorch.layers.linear import Linear, LinearConfig
from axtorch.models import CausalLMInput
from axtorch.models.frozen_base import Int8FrozenBaseConfig
from axtorch.train.adapters import base_digest
from axtorch.train.checkpoint import read_model_tensors
from axtorch.train.flops import active_non_embedding_parameters
from axtorch.train.trained_model import load_trained_model
from axtorch.train.trainer import Trainer, build_model

EVERY_PROJECTION = "model.adapter.target=_proj"  # every projection of attention and feed-forward


def _config(*overrides, frozen_base="int8"):
    return load_experiment_config(
        ["experiment=debug", "model/adapter=lora", f"model/frozen_base={frozen_base}", *overrides]
    )


def _frozen_linear(in_features=48, out_features=24, bias=True):
    torch.manual_seed(0)
    linear = Linear(LinearConfig(bias=bias), in_features, out_features)
    linear.reset_parameters()
    if bias:
        torch.nn.init.normal_(linear.bias)
    linear.requires_grad_(False)
    return linear


def test_the_int8_weight_rounds_each_channel_to_its_own_scale():
    linear = _frozen_linear()
    q, scale = quantize_per_channel_int8(linear.weight)
    assert q.dtype == torch.int8 and scale.shape == (24,)
    assert torch.equal(q.abs().amax(dim=1), torch.full((24,), 127, dtype=torch.int8))  # each row uses the range
    error = (dequantize_per_channel_int8(q, scale) - linear.weight).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-6)).all()  # round to nearest, within half a step
    assert error.max() > 0


def test_the_input_gradient_is_a_float32_linear_s_with_the_dequantised_weight_exactly():
    linear = _frozen_linear()
    frozen = FrozenInt8Linear(linear)
    assert not [name for name, p in frozen.named_parameters() if p.requires_grad]  # no weight gradient to keep
    x = torch.randn(3, 5, 48, requires_grad=True)
    upstream = torch.randn(3, 5, 24)
    out = frozen(x)
    (got,) = torch.autograd.grad(out, x, upstream)

    reference_x = x.detach().clone().requires_grad_(True)
    dequantised = dequantize_per_channel_int8(frozen.weight_int8, frozen.weight_scale)
    reference = F.linear(reference_x, dequantised, linear.bias)
    (expected,) = torch.autograd.grad(reference, reference_x, upstream)
    assert torch.equal(out, reference)
    assert torch.equal(got, expected)


def test_adapter_gradients_are_those_of_the_float32_base_with_the_dequantised_weights():
    int8 = build_model(_config(EVERY_PROJECTION), torch.device("cpu"))
    fp32 = build_model(_config(EVERY_PROJECTION, frozen_base="none"), torch.device("cpu"))
    converted = {name: m for name, m in int8.named_modules() if isinstance(m, FrozenInt8Linear)}
    assert len(converted) == 2 * 7  # q, k, v, o and the three feed-forward projections of 2 layers
    with torch.no_grad():
        for name, module in converted.items():
            fp32.get_submodule(name).weight.copy_(dequantize_per_channel_int8(module.weight_int8, module.weight_scale))
        torch.manual_seed(1)
        for name, parameter in fp32.named_parameters():
            if name.endswith("lora_b"):  # non-zero, so that every adapter has a gradient
                int8.get_parameter(name).copy_(parameter.normal_(std=0.1))
    ids = torch.randint(0, 400, (2, 17))
    gradients = []
    for model in (int8, fp32):
        logits = model(CausalLMInput(ids[:, :-1])).logits
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        gradients.append({name: p.grad for name, p in model.named_parameters() if p.requires_grad})
    assert gradients[0].keys() == gradients[1].keys() and len(gradients[0]) == 2 * 7 * 2
    for name, gradient in gradients[1].items():
        assert gradient.abs().max() > 0, name
        assert torch.equal(gradients[0][name], gradient), name


def test_the_base_linears_hold_a_quarter_of_the_bytes_and_release_their_float32_weights():
    model = build_model(_config(frozen_base="none"), torch.device("cpu"))  # the same base, frozen, in float32
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear) and name.startswith("decoder.")}
    released = {name: weakref.ref(m.weight) for name, m in linears.items()}
    float_bytes = sum(m.weight.nbytes for m in linears.values())
    channels = sum(m.out_features for m in linears.values())
    multiplied = active_non_embedding_parameters(model)
    del linears

    converted = Int8FrozenBaseConfig().build(torch.device("cpu")).apply(model)

    assert sorted(converted) == sorted(released)
    gc.collect()
    assert not [name for name, weight in released.items() if weight() is not None]
    modules = [model.get_submodule(name) for name in converted]
    assert sum(m.weight_int8.nbytes for m in modules) * 4 == float_bytes
    assert sum(m.weight_scale.nbytes for m in modules) == 4 * channels  # one float32 scale per output channel
    assert type(model.lm_head) is Linear and model.embedding.weight.dtype == torch.float32  # they stay
    assert not [name for name in model.state_dict() if "weight_int8" in name or "weight_scale" in name]
    assert active_non_embedding_parameters(model) == multiplied  # the FLOPs count the int8 weights too


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model/adapter=none"], "model.frozen_base"),  # without adapters every weight trains
        (["model/float8=tensorwise"], "model.float8"),
        (["backend=native"], "backend"),
        (["backend=xla"], "backend"),
    ],
)
def test_settings_it_cannot_serve_are_refused_before_any_compute(overrides, key):
    with pytest.raises(ConfigError) as error:
        _config(*overrides)
    assert error.value.key == key
    assert "int8" in str(error.value)


def test_a_skip_list_that_leaves_nothing_to_convert_is_refused():
    with pytest.raises(ConfigError, match=r"model\.frozen_base\.skip"):
        build_model(_config("model.frozen_base.skip=[decoder]"), torch.device("cpu"))


def test_an_int8_base_run_trains_resumes_and_exports_merged_into_its_dequantised_weights(
    tmp_path,
    hf_dir,  # noqa: F811
    data_cache,
):
    def config(run, *extra, frozen_base="int8"):
        return _config(
            f"run_dir={run}",
            f"data.cache_dir={data_cache}",
            "trainer.progress_bar=false",
            "trainer.device=cpu",  # compared with models built on the CPU
            "trainer.plot=false",
            "trainer.tensorboard=false",
            "trainer.eval_batches=1",
            f"init_from=hf:{hf_dir}",
            "trainer.checkpoint_every=2",
            "optim.lr=0.02",
            *extra,
            frozen_base=frozen_base,
        )

    run = tmp_path / "run"
    Trainer(config(tmp_path / "straight", "trainer.max_steps=3")).fit()
    Trainer(config(run, "trainer.max_steps=2")).fit()
    resumed = Trainer(config(run, "trainer.max_steps=3"))
    assert resumed.fit().step == 3
    checkpoint = run / "checkpoints" / "step_00000003"
    saved = read_model_tensors(checkpoint)
    adapters = sorted(name for name, p in resumed.model.named_parameters() if p.requires_grad)
    assert sorted(saved) == adapters  # only the adapters
    expected = read_model_tensors(tmp_path / "straight" / "checkpoints" / "step_00000003")
    assert all(torch.equal(saved[name], expected[name]) for name in adapters)  # as if it never stopped
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["adapter_base_digest"] == base_digest(config(run, frozen_base="none"))  # the original base

    ids = torch.randint(0, 400, (2, 16))
    resumed.model.eval()
    imported, _ = from_hf(hf_dir)
    with torch.no_grad():
        trained = resumed.model(CausalLMInput(ids)).logits
        merged, _ = load_trained_model(run, torch.device("cpu"))
        torch.testing.assert_close(merged(CausalLMInput(ids)).logits, trained, rtol=1e-5, atol=1e-5)
        assert export_main([f"checkpoint={run}", f"to=hf:{tmp_path / 'exported'}"]) == 0
        exported, _ = from_hf(tmp_path / "exported")
        torch.testing.assert_close(exported(CausalLMInput(ids)).logits, trained, rtol=1e-5, atol=1e-5)
    # k_proj holds no adapter: its exported weight is the dequantised original, not the original.
    original = imported.decoder.layers[0].attention.k_proj.weight
    exported_k = exported.decoder.layers[0].attention.k_proj.weight
    assert torch.equal(exported_k, dequantize_per_channel_int8(*quantize_per_channel_int8(original)))
    assert not torch.equal(exported_k, original)
