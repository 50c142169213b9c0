"""Heterogeneous stacks (local/global layer variants) under the backends: FSDP, pipeline stages (split by
the layers' cost), XLA scan."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from debug_runs import STEPS, debug_overrides, train_losses, train_on_one_device
from test_native_backend import train_on_ranks
from xla_runs import ROOT, XLA_PYTHON, needs_xla, xla_env

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.models.causal_lm import CausalLMInput
from axtorch.parallel.pipeline import StageModule, keep_stages
from axtorch.parallel.pipeline_config import layer_ranges, stage_parameter_names
from axtorch.train.flops import layer_flops_per_token
from axtorch.train.trainer import build_model

pytestmark = pytest.mark.journey

#: The debug experiment's data with a 4-layer local/local/global stack, window 8 inside its 64 tokens.
STACK = [
    "model=local_global_tiny",
    "model.vocab_size=512",
    "model.tie_embeddings=false",  # a pipeline's last stage holds its own head
    "model.dim=64",
    "model.decoder.num_layers=4",
    "model.decoder.layer.attention.num_heads=4",
    "model.decoder.layer.feed_forward.hidden_dim=128",
    "model.decoder.variants.local.attention.mask.window=8",
]


@pytest.mark.slow
def test_native_fsdp_losses_of_a_stack_match_a_single_device(tmp_path, data_cache):
    cache = data_cache
    train_on_one_device(tmp_path / "single", cache, *STACK)
    overrides = debug_overrides(tmp_path / "fsdp2", cache, "backend=native", "mesh.fsdp=2", "sharding=fsdp", *STACK)
    assert [report["step"] for report in train_on_ranks(2, tmp_path / "fsdp2", STEPS, overrides)] == [STEPS, STEPS]
    single, sharded = train_losses(tmp_path / "single"), train_losses(tmp_path / "fsdp2")
    assert len(single) == len(sharded) == STEPS
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(single), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_native_pipeline_splits_a_stack_by_its_layers_cost(tmp_path, data_cache):
    """A global layer with a 8x wider feed-forward, then 3 local ones: 2 stages by layer count
    would be 2 + 2 layers (the first stage twice the second's FLOPs); by cost the global layer is
    a stage alone. The run holds that split and trains with one device's losses."""
    stack = [*STACK, "model.decoder.pattern=[global,local,local,local]"]
    stack.append("+model.decoder.variants.global.feed_forward.hidden_dim=1024")
    cache = data_cache
    train_on_one_device(tmp_path / "single", cache, *stack)
    overrides = debug_overrides(tmp_path / "pp2", cache, "backend=native", "mesh.pipe=2", *stack)
    reports = train_on_ranks(2, tmp_path / "pp2", STEPS, overrides)
    config = load_experiment_config(overrides)
    ranges = layer_ranges(layer_flops_per_token(config.model, config.data.seq_len), 2, None)
    assert ranges == [range(0, 1), range(1, 4)]
    with torch.device("meta"):
        sizes = {name: p.numel() for name, p in config.model.build().named_parameters()}
    held = [sum(sizes[name] for name in stage_parameter_names(sizes, ranges, [stage])) for stage in (0, 1)]
    assert [report["params_total"] for report in reports] == held
    single, piped = train_losses(tmp_path / "single"), train_losses(tmp_path / "pp2")
    assert len(single) == len(piped) == STEPS
    torch.testing.assert_close(torch.tensor(piped), torch.tensor(single), rtol=1e-5, atol=1e-5)


def test_pipeline_stages_of_a_stack_keep_each_layers_variant_and_chain_to_the_whole_model():
    config = load_experiment_config(["experiment=debug", *STACK])
    torch.manual_seed(0)
    model = build_model(config, torch.device("cpu"))
    ranges = layer_ranges([1] * config.model.decoder.num_layers, 2, [3])  # a split inside the second period
    windows = [layer.attention.mask.window for layer in model.decoder.layers]
    assert windows == [8, 8, None, 8]
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    hidden = tokens
    for stage, layers in enumerate(ranges):
        part = keep_stages(model, ranges, [stage])
        assert [part.decoder.layers[str(i)].attention.mask.window for i in layers] == windows[
            layers.start : layers.stop
        ]
        hidden = StageModule(part, layers, first=stage == 0, last=stage == len(ranges) - 1)(hidden)
    torch.testing.assert_close(hidden, model(CausalLMInput(tokens)).logits, atol=1e-6, rtol=1e-5)


@needs_xla
@pytest.mark.slow
def test_xla_scan_over_pattern_groups_equals_running_the_layers_unrolled(tmp_path):
    """7 layers of period 3: two scanned groups, one unrolled layer; the same logits and gradients,
    also of rows packing several documents (segment ids in the scan's carry), which equal one
    device's without torch_xla."""
    out = tmp_path / "report.json"
    worker = Path(__file__).with_name("xla_layer_groups.py")
    command = [str(XLA_PYTHON), str(worker), str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=xla_env(1), cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["groups"] == [0, 1] and report["scanned_layers"] == [0, 1, 2, 3, 4, 5]
    assert {name.split(".")[1] for name in report["stacked_names"]} == {"0", "1", "2"}  # a step is one period
    assert report["logits_max_diff"] < 1e-5
    assert report["grads_max_diff"] < 1e-5 * max(1.0, report["grads_max"])
    print(
        f"packed rows, scanned vs unrolled and vs one device (logits, gradients): {report['packed_vs_unrolled']}, "
        f"{report['packed_vs_one_device']}; masking moved the logits by {report['packing_changes_logits']:.3g}"
    )
    assert report["packing_changes_logits"] > 1e-3
    for logits_diff, grads_diff in (report["packed_vs_unrolled"], report["packed_vs_one_device"]):
        assert logits_diff < 1e-5 and grads_diff < 1e-5 * max(1.0, report["packed_grads_max"])
