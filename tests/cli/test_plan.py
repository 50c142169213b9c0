"""``axtorch-plan`` sizes a sharded model per device from its config alone, in seconds."""

import math
import time

import pytest

from axtorch.cli.plan import main, split_plan_options
from axtorch.config.errors import ConfigError
from axtorch.plan import load_plan_inputs, plan
from axtorch.train.flops import transformer_flops_per_token

LLAMA3_70B_ON_256 = ["model=llama3_70b", "mesh.fsdp=32", "mesh.model=8", "sharding=fsdp_tp"]


@pytest.fixture(scope="module")
def llama3_70b():
    start = time.perf_counter()
    config, mesh_sizes = load_plan_inputs(LLAMA3_70B_ON_256)
    result = plan(config, mesh_sizes, batch_size=1, seq_len=8192)
    return config, result, time.perf_counter() - start


def test_70b_on_256_devices_splits_every_matrix_256_ways(llama3_70b):
    config, result, seconds = llama3_70b
    assert seconds < 30
    assert result.num_devices == 256
    dim, layers = config.model.dim, config.model.decoder.num_layers
    replicated_norms = (2 * layers + 1) * dim
    expected = 4 * ((result.total_parameters - replicated_norms) // 256 + replicated_norms)
    memory = result.memory
    assert memory.parameter_bytes == expected
    assert memory.parameter_bytes == pytest.approx(4 * result.total_parameters / 256, rel=0.01)
    assert memory.gradient_bytes == memory.parameter_bytes
    assert memory.optimizer_bytes == 2 * memory.parameter_bytes


def test_70b_rows_collapse_the_layers_and_show_the_shards(llama3_70b):
    _, result, _ = llama3_70b
    rows = {group.name: group for group in result.parameters}
    q_proj = rows["decoder.layers.{0..79}.attention.q_proj.weight"]
    assert (q_proj.count, q_proj.shape, q_proj.spec, q_proj.shard_shape) == (
        80,
        (8192, 8192),
        (("model",), ("fsdp",)),
        (1024, 256),
    )
    assert rows["decoder.layers.{0..79}.feed_forward.down_proj.weight"].shard_shape == (256, 3584)
    assert rows["lm_head.weight"].shard_shape == (16032, 256)
    assert sum(group.count for group in result.parameters) == 2 + 9 * 80 + 1


def test_70b_flops_and_activations(llama3_70b):
    config, result, _ = llama3_70b
    model = config.model
    non_embedding = result.total_parameters - model.vocab_size * model.dim
    assert result.flops_per_token == transformer_flops_per_token(
        non_embedding, model.decoder.num_layers, model.dim, 8192, model.vocab_size, tied=False
    )
    # Per token of a layer, t=8: the two RMSNorms' inputs, normalised inputs and outputs whole
    # (6 x 8192), the rotated queries and keys, the values, attention's output twice and the
    # SwiGLU's four hidden widths split (2 x 8192 + 2 x 1024 + 4 x 28672) / 8, a log-sum-exp per
    # local head (64 / 8) and RoPE's cosines and sines (2 x 128): 66,056 values, 4 bytes each
    # under the default fp32 (the dry run of the 70B's layers measured 66,058). The model adds
    # the final norm's three widths and the fused head's gradient of its input (4 x 8192).
    per_layer, head = 6 * 8192 + (2 * 8192 + 2 * 1024 + 4 * 28672) / 8 + 64 / 8 + 2 * 128, 4 * 8192
    assert per_layer == 66_056
    assert result.memory.activation_bytes == round(4 * 8192 * (80 * per_layer + head))
    assert result.remat == "none"
    remat_config, remat_mesh = load_plan_inputs([*LLAMA3_70B_ON_256, "model/remat=full"])
    remat = plan(remat_config, remat_mesh, batch_size=1, seq_len=8192)
    assert remat.remat == "full"
    assert remat.memory.activation_bytes == round(4 * 8192 * (80 * 8192 + per_layer + head))
    assert remat.memory.parameter_bytes == result.memory.parameter_bytes
    # Selective keeps each layer's input plus the named activations: the attention context is
    # 8192/8 features per token per device and the SwiGLU hidden 28672/8.
    selective_config, _ = load_plan_inputs([*LLAMA3_70B_ON_256, "model/remat=selective"])
    selective = plan(selective_config, remat_mesh, batch_size=1, seq_len=8192)
    assert selective.memory.activation_bytes == round(4 * 8192 * (80 * (8192 + 1024 + 3584) + per_layer + head))


def test_activations_follow_the_compute_precision(llama3_70b, capsys):
    """bf16 autocast holds activations in 2 bytes, fp32 in 4; parameters and AdamW state stay fp32."""
    _, fp32, _ = llama3_70b
    config, mesh_sizes = load_plan_inputs([*LLAMA3_70B_ON_256, "trainer.precision=bf16"])
    bf16 = plan(config, mesh_sizes, batch_size=1, seq_len=8192)
    per_layer, head = 66_056, 4 * 8192  # values a token: test_70b_flops_and_activations
    assert bf16.memory.activation_bytes == round(2 * 8192 * (80 * per_layer + head))
    assert 2 * bf16.memory.activation_bytes == fp32.memory.activation_bytes
    assert bf16.memory.parameter_bytes == fp32.memory.parameter_bytes
    assert main([*LLAMA3_70B_ON_256, "trainer.precision=bf16", "seq_len=8192"]) == 0
    out = capsys.readouterr().out
    assert "activations (bf16, batch 1 x seq 8192, remat=none)" in out and "precision: bf16 matmuls" in out


def test_mesh_that_does_not_divide_a_dimension_is_a_config_error():
    config, mesh_sizes = load_plan_inputs(["model=llama3_8b", "mesh.fsdp=3", "sharding=fsdp"])
    with pytest.raises(ConfigError) as info:
        plan(config, mesh_sizes)
    assert info.value.key == "sharding.parameters[0].spec"
    assert "dim 0 has size 4096, not divisible by fsdp=3" in str(info.value)


def test_a_mesh_that_splits_a_key_value_head_is_a_config_error_before_any_pricing():
    """The train-time check, run against the planned mesh (the machine's own is one device)."""
    with pytest.raises(ConfigError) as info:
        load_plan_inputs(["model=llama3_8b", "mesh.fsdp=4", "mesh.model=16", "sharding=fsdp_tp"])
    assert (info.value.key, info.value.value) == ("mesh.model", 16)
    assert "a divisor of the 8 key/value heads" in str(info.value)


def test_inferred_axis_needs_the_device_count():
    with pytest.raises(ConfigError) as info:
        load_plan_inputs(["mesh.fsdp=-1"])
    assert info.value.key == "devices"
    _, mesh_sizes = load_plan_inputs(["mesh.fsdp=-1", "mesh.model=2"], devices=16)
    assert mesh_sizes["fsdp"] == 8 and math.prod(mesh_sizes.values()) == 16


def test_plan_options_are_split_from_the_overrides():
    overrides, options = split_plan_options(
        ["model=llama3_8b", "batch=4", "seq_len=2048", "model/remat=full", "devices=8"]
    )
    assert overrides == ["model=llama3_8b", "model/remat=full"]
    assert (options.batch, options.seq_len, options.devices) == (4, 2048, 8)
    with pytest.raises(ConfigError, match="batch"):
        split_plan_options(["batch=some"])


def test_command_prints_the_plan_and_exits_2_on_a_bad_mesh(capsys):
    assert main(LLAMA3_70B_ON_256) == 0
    out = capsys.readouterr().out
    assert "(256 devices)" in out and "decoder.layers.{0..79}.attention.q_proj.weight" in out
    assert main(["sharding=fsdp", "mesh.fsdp=5"]) == 2
    assert "not divisible by fsdp=5" in capsys.readouterr().err


def test_mixtral_expert_parallel_plan_holds_one_expert_per_device_and_counts_active_flops(capsys):
    overrides = ["model=mixtral_8x7b", "mesh.expert=8", "mesh.fsdp=32", "sharding=fsdp_ep"]
    config, mesh_sizes = load_plan_inputs(overrides)
    result = plan(config, mesh_sizes, seq_len=4096)
    rows = {group.name: group for group in result.parameters}
    experts = rows["decoder.layers.{0..31}.feed_forward.experts.gate_proj"]
    assert (experts.shape, experts.shard_shape) == ((8, 14336, 4096), (1, 448, 4096))
    assert rows["decoder.layers.{0..31}.feed_forward.experts.down_proj"].shard_shape == (1, 128, 14336)
    # Experts split 256 ways, everything else 32 ways (replicated over `expert`), norms whole.
    model = config.model
    expert_elements = 32 * 3 * 8 * 14336 * 4096
    norms = (2 * 32 + 1) * 4096
    per_device = expert_elements // 256 + (result.total_parameters - expert_elements - norms) // 32 + norms
    assert result.memory.parameter_bytes == 4 * per_device
    # FLOPs count the 2 of 8 experts each token uses: Mixtral's published 12.9B active parameters.
    assert result.active_parameters == pytest.approx(12.9e9, rel=0.01)
    non_embedding = result.active_parameters - model.vocab_size * model.dim
    assert result.flops_per_token == transformer_flops_per_token(non_embedding, 32, 4096, 4096, 32000, tied=False)
    # The report alone: the dry run's check of it by default is test_plan_check.py's (here 35 s of tracing).
    assert main([*overrides, "seq_len=4096", "check=false"]) == 0
    assert "active parameters per token: 12,879,925,248 (12.88B)" in capsys.readouterr().out


def test_a_pipeline_plan_holds_one_stage_per_process_and_reports_its_bubble(capsys):
    flat, flat_sizes = load_plan_inputs(["model=llama3_70b", "mesh.fsdp=32", "mesh.model=8", "sharding=fsdp_tp"])
    overrides = ["model=llama3_70b", "mesh.pipe=4", "mesh.fsdp=8", "mesh.model=8", "sharding=fsdp_tp"]
    config, mesh_sizes = load_plan_inputs([*overrides, "pipeline.microbatches=16"])
    piped, whole = plan(config, mesh_sizes), plan(flat, flat_sizes)
    assert piped.stage_layers == [range(0, 20), range(20, 40), range(40, 60), range(60, 80)]
    # A quarter of the layers on each process, split 64 ways instead of 256: about the same bytes,
    # plus the embedding table (or the head) whole on its stage's 64 devices.
    layer = (whole.total_parameters - 2 * 128256 * 8192 - 8192) / 80
    first_stage = 20 * layer + 128256 * 8192
    assert piped.memory.parameter_bytes == pytest.approx(4 * first_stage / 64, rel=0.01)
    # 1F1B: the first process holds 4 micro-batches of its 20 layers, as many as 80 layers of one.
    assert piped.memory.activation_bytes == whole.memory.activation_bytes
    assert piped.bubble == pytest.approx(3 / (16 + 3))
    assert main([*overrides, "pipeline.schedule=gpipe", "pipeline.microbatches=8"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 4 stages, layers 0..19 | 20..39 | 40..59 | 60..79" in out
    assert "pipeline bubble: 27.3% of each step idle" in out
    assert main([*overrides, "pipeline.microbatches=2"]) == 2
    assert "pipeline.microbatches=2" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "precision: fp32 throughout"),
        (
            ["backend=native", "mesh.fsdp=2", "trainer.precision=bf16", "trainer.reduce_precision=bf16"],
            "precision: bf16 matmuls (autocast); FSDP (native) gathers bf16 parameters and reduces gradients in bf16",
        ),
        (["model/float8=tensorwise"], "precision: fp32; decoder linears in float8 (tensorwise scales, torchao)"),
    ],
)
def test_the_plan_states_the_precision_policy(capsys, overrides, expected):
    assert main(["experiment=debug", *overrides]) == 0
    assert expected in capsys.readouterr().out


def test_the_launchers_mesh_plans_with_the_sharding_auto_chooses(capsys):
    """The TPU and Trainium launch examples' ``mesh.fsdp=-1`` without ``sharding=``: the report says
    which preset ``sharding=auto`` chose, and each device holds a 64th of the state, not all of it."""
    assert main(["model=llama3_8b", "backend=xla", "mesh.fsdp=-1", "devices=64"]) == 0
    out = capsys.readouterr().out
    assert "sharding: fsdp, as sharding=auto chose it for this mesh" in out
    config, mesh_sizes = load_plan_inputs(["model=llama3_8b", "mesh.fsdp=-1"], devices=64)
    result = plan(config, mesh_sizes)
    assert result.auto_sharding == "fsdp"
    assert result.memory.parameter_bytes == pytest.approx(4 * result.total_parameters / 64, rel=0.01)
