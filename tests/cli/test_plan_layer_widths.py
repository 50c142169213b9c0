"""The planner's activation model held to the dry run, one layer kind at a time.

Each layer config declares what its backward keeps per token (``TransformerLayerConfig.saved_width``);
the dry run of the same model with twice the layers measures it: the activations at its peak grow
by one layer's worth per layer added. Small widths, so that each trace takes a few seconds, and
tokens enough that the activations, not the weights and their gradients, make the peak.
"""

from __future__ import annotations

import math

import pytest

from axtorch.plan import load_plan_inputs
from axtorch.train.dry_run import dry_run

BATCH, SEQ = 2, 256
#: A Llama-style layer of distinct widths (model 128, 4 query heads of 32, 2 key/value heads, hidden 320).
LLAMA = [
    "model=llama_debug",
    "model.dim=128",
    "model.decoder.layer.attention.num_heads=4",
    "model.decoder.layer.attention.num_kv_heads=2",
    "model.decoder.layer.feed_forward.hidden_dim=320",
]
CASES = {
    "rmsnorm-swiglu-rope-gqa": (LLAMA, 2),
    "tensor-parallel": ([*LLAMA, "mesh.model=2", "sharding=fsdp_tp"], 2),
    "gelu-mlp": ([*LLAMA, "model/ffn=gelu"], 2),
    "layernorm": ([*LLAMA, "model/norm=layernorm"], 2),
    "qk-norm": ([*LLAMA, "model/qk_norm=rmsnorm"], 2),
    "mixture-of-experts": (["model=mixtral_tiny"], 2),
    # Each process keeps the rows it sent back for the backward; its experts, gathered whole over
    # fsdp, it gathers again there rather than keeping them (the activations do not grow by them).
    "expert-parallel": (["model=mixtral_tiny", "mesh.fsdp=2", "mesh.expert=2", "sharding=fsdp_ep"], 2),
    # Sandwich norms, query and key norms, a GELU-gated feed-forward, sliding windows: whole patterns.
    "gemma3": (["model=gemma3_tiny"], 6),
}


def _replicas(overrides: list[str]) -> int:
    """Data-parallel replicas other than ``expert`` (whose processes split the batch without raising it)."""
    return math.prod(int(o.split("=")[1]) for o in overrides if o.startswith(("mesh.data=", "mesh.fsdp=")))


def _activations(overrides: list[str], layers: int) -> tuple[int, float, int]:
    """The dry run's activations at its peak, the planner's width of one layer (values a token) and
    the tokens of this process's rows (under expert parallelism each takes its share of the batch)."""
    config, mesh = load_plan_inputs(
        [
            *overrides,
            "backend=native",
            f"model.decoder.num_layers={layers}",
            f"trainer.batch_size={BATCH * _replicas(overrides)}",
            f"data.seq_len={SEQ}",
        ]
    )
    model, tokens = config.model, BATCH * SEQ * _replicas(overrides) // (mesh["data"] * mesh["fsdp"] * mesh["expert"])
    widths = []
    for layer in model.decoder.layer_configs():
        held_width, _ = layer.feed_forward.expert_parallel_held(model.dim, mesh["expert"])  # experts: one layer's
        held = held_width if mesh["expert"] > 1 else 0.0
        widths.append(layer.saved_width(model.dim, mesh["model"]) + held)
    return dry_run(config, mesh).memory_at_peak["activations"], sum(widths) / len(widths), tokens


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_layers_declared_activations_are_what_the_dry_run_finds_it_keeps(case):
    overrides, layers = CASES[case]
    fewer, width, tokens = _activations(overrides, layers)
    more, _, _ = _activations(overrides, 2 * layers)
    per_layer = (more - fewer) / layers / (tokens * 4)  # fp32 values a token
    assert width == pytest.approx(per_layer, rel=0.03), (width, per_layer)
