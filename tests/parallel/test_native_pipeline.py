"""Pipeline parallelism under torchrun (gloo on CPU): each schedule trains with one device's losses."""

import itertools
import random

import pytest
import torch
from debug_runs import STEPS, debug_overrides, train_losses, train_on_one_device
from test_native_backend import train_on_ranks

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.parallel.pipeline_config import PipelineConfig, balanced_starts, layer_ranges, stages_of_process
from axtorch.train.flops import (
    active_non_embedding_parameters,
    active_parameters,
    layer_flops_per_token,
    model_flops_per_token,
)

pytestmark = pytest.mark.journey

FOUR_LAYERS = "model.decoder.num_layers=4"


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule",
    [
        # Layers 0-2 on the first process, 3 on the second; 2 micro-batches of 4 rows.
        ["pipeline.schedule=gpipe", "pipeline.split_points=[3]", "pipeline.microbatches=2"],
        # 2 stages per process: process 0 runs layers 0 and 2, process 1 layers 1 and 3.
        ["pipeline.schedule=interleaved_1f1b", "pipeline.stages_per_process=2"],
    ],
    ids=["gpipe_uneven_split", "interleaved_1f1b"],
)
def test_each_schedule_matches_a_single_device(schedule, tmp_path, data_cache):
    cache = data_cache
    train_on_one_device(tmp_path / "single", cache, FOUR_LAYERS)
    overrides = debug_overrides(tmp_path / "pp2", cache, "backend=native", "mesh.pipe=2", FOUR_LAYERS, *schedule)
    reports = train_on_ranks(2, tmp_path / "pp2", STEPS, overrides)
    assert [report["step"] for report in reports] == [STEPS, STEPS]
    single, piped = train_losses(tmp_path / "single"), train_losses(tmp_path / "pp2")
    assert len(single) == len(piped) == STEPS
    torch.testing.assert_close(torch.tensor(piped), torch.tensor(single), rtol=1e-5, atol=1e-5)
    # Each process holds only its stages' parameters, and together they hold the model once.
    with torch.device("meta"):
        whole = load_experiment_config(overrides).model.build()
    held = [report["params_total"] for report in reports]
    assert sum(held) == sum(p.numel() for p in whole.parameters())
    assert all(0 < count < sum(held) for count in held)
    # MFU counts the whole model's FLOPs on every stage, not the stage's own.
    config = load_experiment_config(overrides)
    expected = model_flops_per_token(config.model, config.data.seq_len)
    assert [report["flops_per_token"] for report in reports] == [expected, expected]


def test_layers_split_evenly_or_at_the_given_points():
    assert layer_ranges([1] * 5, 2, None) == [range(0, 3), range(3, 5)]
    assert layer_ranges([1] * 4, 4, None) == [range(i, i + 1) for i in range(4)]
    assert layer_ranges([1] * 4, 2, [1]) == [range(0, 1), range(1, 4)]
    assert layer_ranges([9, 1, 1, 1], 2, [3]) == [range(0, 3), range(3, 4)]  # given points win over costs
    assert stages_of_process(1, 2, 2) == [1, 3]
    with pytest.raises(ConfigError, match=r"pipeline.split_points=\[2, 2\].*3 stages of at least one layer"):
        layer_ranges([1] * 4, 3, [2, 2])
    with pytest.raises(ConfigError, match=r"model.decoder.num_layers=2.*at least the 4 pipeline stages"):
        layer_ranges([1] * 2, 4, None)


def test_equal_costs_split_exactly_as_evenly_as_the_layer_count_did():
    for num_layers in range(1, 41):
        for stages in range(1, num_layers + 1):
            base, extra = divmod(num_layers, stages)  # the split before costs: the extra layers first
            sizes = [base + (stage < extra) for stage in range(stages)]
            assert balanced_starts([7] * num_layers, stages) == [sum(sizes[:stage]) for stage in range(stages)]


def _stage_costs(costs: list[int], starts: list[int]) -> list[int]:
    return [sum(costs[a:b]) for a, b in zip(starts, [*starts[1:], len(costs)])]


def test_the_costliest_stage_is_the_cheapest_any_contiguous_split_gives():
    rng = random.Random(0)
    for _ in range(300):
        costs = [rng.randint(1, 20) for _ in range(rng.randint(1, 9))]
        stages = rng.randint(1, len(costs))
        splits = [[0, *cuts] for cuts in itertools.combinations(range(1, len(costs)), stages - 1)]
        best = min(max(_stage_costs(costs, split)) for split in splits)
        most_even = min(
            sum(c * c for c in _stage_costs(costs, split))
            for split in splits
            if max(_stage_costs(costs, split)) == best
        )
        starts = balanced_starts(costs, stages)
        assert len(starts) == stages and starts == sorted(set(starts)) and starts[0] == 0
        assert max(_stage_costs(costs, starts)) == best
        assert sum(c * c for c in _stage_costs(costs, starts)) == most_even


def test_gemma3_at_a_long_sequence_splits_by_cost_not_by_layer_count():
    """Gemma 3 270M at 32k tokens: a global layer (every 6th) scores 32768 keys, a local one 512."""
    config = load_experiment_config(["model=gemma3_270m", "model.max_seq_len=32768", "data.seq_len=32768"])
    costs = layer_flops_per_token(config.model, 32768)
    assert costs[5] > 7 * costs[0] and len(set(costs)) == 2
    for stages in (2, 3, 4):
        by_cost = layer_ranges(costs, stages, None)
        starts = [r.start for r in by_cost]
        by_count = balanced_starts([1] * len(costs), stages)
        print(
            f"{stages} stages: by cost {[len(r) for r in by_cost]} layers, largest stage "
            f"{max(_stage_costs(costs, starts)) / 1e9:.3f} GFLOPs/token; by count "
            f"{max(_stage_costs(costs, by_count)) / 1e9:.3f}"
        )
        assert max(_stage_costs(costs, starts)) <= max(_stage_costs(costs, by_count))
    # 2 stages by count hold 1 and 2 global layers (0.832 GFLOPs/token the larger): by cost, 11 and 7 layers.
    assert [len(r) for r in layer_ranges(costs, 2, None)] == [11, 7]
    assert max(_stage_costs(costs, [0, 11])) < 0.95 * max(_stage_costs(costs, [0, 9]))
    assert [len(r) for r in layer_ranges(costs, 3, None)] == [6, 6, 6]  # one global layer each, as by count
    # At the training length of its preset (256 tokens, inside the window) every layer costs the same.
    assert len(set(layer_flops_per_token(config.model, 256))) == 1


@pytest.mark.parametrize("preset", ["local_global_tiny", "mixtral_tiny", "llama_debug"])
def test_the_layers_costs_are_the_model_flops_of_its_layers(preset):
    """What ``layer_flops_per_token`` gives the layers, with the head's and final norm's weights,
    is ``model_flops_per_token``: a window and routed experts counted as for MFU."""
    config = load_experiment_config([f"model={preset}", "data.seq_len=128"]).model
    with torch.device("meta"):
        network = config.build()
    outside = active_non_embedding_parameters(network) - sum(
        active_parameters(layer) for layer in network.decoder.layers
    )
    tied = config.vocab_size * config.dim if config.tie_embeddings else 0
    costs = layer_flops_per_token(config, 128)
    assert sum(costs) + 6 * (outside + tied) == model_flops_per_token(config, 128)


@pytest.mark.parametrize(
    ("overrides", "key", "message"),
    [
        (["pipeline.schedule=zero_bubble"], "pipeline.schedule", "one of ['gpipe', '1f1b', 'interleaved_1f1b']"),
        (["pipeline.schedule=interleaved_1f1b"], "pipeline.stages_per_process", "2 or more"),
        (["pipeline.microbatches=3"], "pipeline.microbatches", "dividing the 8 rows"),
        (["pipeline.microbatches=1"], "pipeline.microbatches", "at least the 2 stages"),
        (["trainer.grad_accum_steps=2"], "trainer.grad_accum_steps", "micro-batches accumulate"),
        (["backend=xla"], "backend", "only torchrun runs stages"),
        (["model.tie_embeddings=true"], "model.tie_embeddings", "share the embedding table"),
        (["model=mixtral_tiny", "model.tie_embeddings=false"], "model.decoder.layer.feed_forward", "auxiliary losses"),
        (["mesh.seq=2"], "mesh.seq", "context parallelism inside stages"),
    ],
)
def test_impossible_pipelines_are_config_errors(overrides, key, message):
    with pytest.raises(ConfigError) as error:
        load_experiment_config(["experiment=debug", "backend=native", "mesh.pipe=2", *overrides])
    assert error.value.key == key
    assert message in str(error.value)


def test_the_default_micro_batch_count_is_the_most_up_to_twice_the_stages_that_divides_the_rows():
    assert PipelineConfig().resolved_microbatches(2, 8) == 4
    assert PipelineConfig().resolved_microbatches(2, 6) == 3
    assert PipelineConfig().resolved_microbatches(2, 2) == 2
    assert PipelineConfig(schedule="interleaved_1f1b", stages_per_process=2).resolved_microbatches(2, 16) == 8
    assert PipelineConfig(microbatches=5).resolved_microbatches(2, 8) == 5  # then refused by validate
