"""axtorch's compiled kernels as torch operators (``axtorch::matvec``, ``axtorch::decode_layer``):
``torch.compile`` traces through them without a graph break, ``torch.export`` records them, and
what they write (the KV cache, the hidden state) is visible to torch, in a trace and eagerly."""

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.infer import decode_weights, native_layers
from axtorch.infer.native_kernels import NativeLinear, compiler, reads_codes
from axtorch.infer.native_layers import NativeLayerRunner
from axtorch.infer.weight_codes import encode
from axtorch.models import CausalLMInput
from axtorch.train.trainer import build_model
from tests.gguf_blocks import expanded

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler on this machine")


def _linear(coded: bool = False) -> tuple[NativeLinear, torch.Tensor]:
    """A product of float32 weights, or of weights expanded from GGUF blocks (read as their codes)."""
    generator = torch.Generator().manual_seed(0)
    weight, bias, x = (torch.randn(shape, generator=generator) for shape in ((24, 64), (24,), (1, 1, 64)))
    codes = None
    if coded:
        weight = expanded(weight, "Q4_1")
        codes = encode(weight)
        assert codes is not None
    return NativeLinear(weight, bias, codes), x


@pytest.mark.parametrize("coded", [False, True])
@torch.no_grad()
def test_compile_traces_the_product_as_one_graph(coded):
    linear, x = _linear(coded)
    compiled = torch.compile(linear, backend="aot_eager", fullgraph=True)  # fullgraph: a break fails
    torch.testing.assert_close(compiled(x), linear(x), rtol=0, atol=0)


@pytest.mark.parametrize("coded", [False, True])
@torch.no_grad()
def test_export_records_the_product_and_the_program_computes_it(coded):
    linear, x = _linear(coded)
    program = torch.export.export(linear, (x,))
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert "axtorch.matvec.default" in targets, targets
    torch.testing.assert_close(program.module()(x), linear(x), rtol=0, atol=0)


@pytest.fixture(params=[False, True], ids=["float32", "coded"])
def layer_arguments(request):
    """One recognised layer's step inputs: the model's first layer, a fresh cache, position 0; its
    weights float32, or expanded from GGUF blocks and read as their codes."""
    torch.manual_seed(0)
    model = build_model(load_experiment_config(["experiment=debug"]), torch.device("cpu")).eval()
    if request.param:
        if not reads_codes():
            pytest.skip("decoding keeps float32 weights here (kernels built for neither AVX2 nor AVX-512)")
        with torch.no_grad():
            for parameter in model.decoder.layers[0].parameters():
                if parameter.dim() == 2:
                    parameter.copy_(expanded(parameter, "Q4_1"))
    with decode_weights(model):
        runner = model.decoder.layer_runner
        assert isinstance(runner, NativeLayerRunner)
        native = runner.layers[0]
        assert native is not None
        cache = model.allocate_kv_caches(1, 8, dtype=torch.float32, device="cpu")[0]
        cos, sin = native.rotary.tables(torch.tensor([[0]]), torch.device("cpu"), None)
        inputs = {
            "x": torch.randn(1, 1, model.config.dim),
            "keys": cache.keys,
            "values": cache.values,
            "scratch": torch.empty(runner.scratch_floats(native.struct, cache.max_len, 1)),
            "allowed": torch.zeros(1, cache.max_len, dtype=torch.bool).index_fill_(1, torch.tensor([0]), True),
            "slots": torch.zeros(1, dtype=torch.long),
            "cos": cos.contiguous(),
            "sin": sin.contiguous(),
        }
        assert (native.weights[native_layers.WEIGHTS.index("qkv_codes")] is not None) == request.param
        constants = {"weights": native.weights, "sizes": native.sizes, "constants": native.constants}
        yield inputs, constants


@torch.no_grad()
def test_compile_traces_the_layer_step_and_its_cache_writes(layer_arguments):
    inputs, constants = layer_arguments

    def step(**tensors):
        torch.ops.axtorch.decode_layer(**tensors, **constants, threads=1)

    eager = {name: t.clone() for name, t in inputs.items()}
    step(**eager)
    assert eager["keys"].abs().sum() > 0  # the step wrote the cache
    traced = {name: t.clone() for name, t in inputs.items()}
    torch.compile(step, backend="aot_eager", fullgraph=True)(**traced)
    for name in ("x", "keys", "values"):  # written in place, through the trace, as eagerly
        torch.testing.assert_close(traced[name], eager[name], rtol=0, atol=0)


@torch.no_grad()
def test_an_eager_decode_step_bumps_the_versions_of_what_it_writes():
    """Eager steps call the library directly (no dispatcher), so they bump the versions themselves."""
    torch.manual_seed(0)
    model = build_model(load_experiment_config(["experiment=debug"]), torch.device("cpu")).eval()
    caches = model.allocate_kv_caches(1, 8, dtype=torch.float32, device="cpu")
    with decode_weights(model):
        assert isinstance(model.decoder.layer_runner, NativeLayerRunner)
        before = [(c.keys._version, c.values._version) for c in caches]
        model(CausalLMInput(input_ids=torch.tensor([[3]]), positions=torch.tensor([[0]]), kv_caches=caches))
    after = [(c.keys._version, c.values._version) for c in caches]
    assert all(a[0] > b[0] and a[1] > b[1] for a, b in zip(after, before)), (before, after)
