"""The mixture-of-experts presets: published active sizes, sharding coverage, and a tiny run that learns."""

import copy

import pytest
from meta_presets import build_on_meta

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.interop.pretrained import check_same_architecture
from axtorch.parallel.mesh import MeshConfig
from axtorch.parallel.sharding import resolve_parameter_specs
from axtorch.train.flops import active_parameters
from axtorch.train.trainer import Trainer

#: preset -> parameters each token uses, as published (Mixtral's paper; Qwen3's model card).
PUBLISHED_ACTIVE_PARAMETERS = {"mixtral_8x7b": 12.9e9, "qwen3_30b_a3b": 3.3e9}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_ACTIVE_PARAMETERS))
def test_active_parameter_count_matches_the_published_figure(preset):
    _, model = build_on_meta(f"model={preset}")
    assert active_parameters(model) == pytest.approx(PUBLISHED_ACTIVE_PARAMETERS[preset], rel=0.02)


SHARED_EXPERTS = [
    "model/shared_experts=swiglu",
    "model.decoder.layer.feed_forward.shared_experts.hidden_dim=64",
    "model.decoder.layer.feed_forward.shared_expert_gate=true",
]


@pytest.mark.parametrize("sharding", ["replicated", "fsdp", "fsdp_tp", "fsdp_ep"])
@pytest.mark.parametrize(
    "model",
    [["model=mixtral_tiny"], ["model=qwen3_moe_tiny"], ["model=mixtral_tiny", *SHARED_EXPERTS], ["model=llama_debug"]],
    ids=["mixtral_tiny", "qwen3_moe_tiny", "shared_experts", "dense"],
)
def test_every_sharding_preset_covers_mixture_of_experts_parameters(model, sharding):
    config, network = build_on_meta(*model, f"sharding={sharding}")
    shapes = {name: tuple(p.shape) for name, p in network.named_parameters()}
    mesh = MeshConfig(fsdp=2, expert=2, model=2).resolve(8)
    specs = resolve_parameter_specs(shapes, config.sharding, mesh)
    assert set(specs) == set(shapes)
    experts = {name: spec for name, spec in specs.items() if ".experts." in name}
    assert len(experts) == (3 * config.model.decoder.num_layers if model != ["model=llama_debug"] else 0)
    expected = {
        "replicated": (None, None, None),
        "fsdp": (None, ("fsdp",), None),
        "fsdp_tp": (None, ("fsdp",), None),
        "fsdp_ep": (("expert",), ("fsdp",), None),
    }[sharding]
    assert all(spec == expected for spec in experts.values())


def test_a_tiny_mixture_of_experts_run_learns(tmp_path, data_cache):
    config = load_experiment_config(
        [
            "experiment=debug",
            "model=mixtral_tiny",
            f"run_dir={tmp_path / 'run'}",
            f"data.cache_dir={data_cache}",
            "trainer.progress_bar=false",
            "trainer.max_steps=20",
            "model.vocab_size=512",
            "model.dim=64",
            "model.decoder.num_layers=2",
            "model.decoder.layer.attention.num_heads=4",
            "model.decoder.layer.feed_forward.hidden_dim=64",
            "model.decoder.layer.feed_forward.num_experts=4",
        ]
    )
    trainer = Trainer(config)
    non_embedding = sum(p.numel() for n, p in trainer.model.named_parameters() if n != "embedding.weight")
    unused_experts = 2 * 2 * 3 * 64 * 64  # per layer, 2 of the 4 experts' three [64, 64] matrices
    tied_head, attention = 512 * 64, 12 * 2 * 64 * config.data.seq_len
    assert trainer.flops_per_token == 6 * (non_embedding - unused_experts + tied_head) + attention
    result = trainer.fit()
    assert result.final_eval_loss < result.initial_eval_loss - 0.5


def test_init_from_ignores_router_loss_weights_but_not_the_experts():
    ours = load_experiment_config(["model=mixtral_tiny"]).model
    theirs = copy.deepcopy(ours)
    theirs.decoder.layer.feed_forward.router.load_balancing_loss_weight = 0.02 / 4
    theirs.decoder.layer.feed_forward.router.z_loss_weight = 0.0
    check_same_architecture(ours, theirs, "hf:mixtral")
    theirs.decoder.layer.feed_forward.num_experts = 16
    with pytest.raises(ConfigError, match="num_experts=8 vs 16"):
        check_same_architecture(ours, theirs, "hf:mixtral")
