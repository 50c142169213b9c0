"""Pipeline parallelism under torchrun (gloo on CPU): each schedule trains with one device's losses."""

import pytest
import torch
from debug_runs import STEPS, debug_overrides, train_losses, train_on_one_device
from test_native_backend import _torchrun

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.parallel.pipeline_config import PipelineConfig, layer_ranges, stages_of_process
from axtorch.train.flops import model_flops_per_token

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
def test_each_schedule_matches_a_single_device(schedule, tmp_path):
    cache = tmp_path / "cache"
    train_on_one_device(tmp_path / "single", cache, FOUR_LAYERS)
    overrides = debug_overrides(tmp_path / "pp2", cache, "backend=native", "mesh.pipe=2", FOUR_LAYERS, *schedule)
    reports = _torchrun(2, tmp_path / "pp2", STEPS, overrides)
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
    assert layer_ranges(5, 2, None) == [range(0, 3), range(3, 5)]
    assert layer_ranges(4, 4, None) == [range(i, i + 1) for i in range(4)]
    assert layer_ranges(4, 2, [1]) == [range(0, 1), range(1, 4)]
    assert stages_of_process(1, 2, 2) == [1, 3]
    with pytest.raises(ConfigError, match=r"pipeline.split_points=\[2, 2\].*3 stages of at least one layer"):
        layer_ranges(4, 3, [2, 2])
    with pytest.raises(ConfigError, match=r"model.decoder.num_layers=2.*at least the 4 pipeline stages"):
        layer_ranges(2, 4, None)


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
