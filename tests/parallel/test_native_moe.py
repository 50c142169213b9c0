"""A mixture-of-experts model under the native backend (torchrun, gloo on CPU) trains as on one device.

The router z-loss is on: it is a mean over each replica's tokens, and the trainer must weigh the
replicas' aux losses as their mean. The load-balancing loss is off: its statistics (fractions of
tokens per expert, times mean probabilities) are per forward call, so replicas computing it on
their own rows legitimately differ from one device computing it on the whole batch.
"""

from pathlib import Path

import pytest
import torch
from debug_runs import STEPS, debug_overrides, train_losses, train_on_one_device
from forked_ranks import run_ranks

from axtorch.train.checkpoint import read_model_tensors

pytestmark = pytest.mark.journey

WORKER = Path(__file__).with_name("native_worker.py")
MOE = [
    "model=mixtral_tiny",
    "model.vocab_size=512",
    "model.dim=64",
    "model.decoder.num_layers=2",
    "model.decoder.layer.attention.num_heads=4",
    "model.tie_embeddings=false",
    "model.decoder.layer.feed_forward.hidden_dim=64",
    "model.decoder.layer.feed_forward.num_experts=4",
    "model.decoder.layer.feed_forward.router.load_balancing_loss_weight=0.0",
    "model.decoder.layer.feed_forward.router.z_loss_weight=0.01",
]


#: Experts take at most their share of a call's assignments (top-2 of 4 experts: half the tokens each).
CAPACITY = "model.decoder.layer.feed_forward.capacity_factor=1.0"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("processes", "mesh", "one_device"),
    [
        # Experts under FSDP (not split by expert), beside tensor-parallel attention.
        (4, ["mesh.fsdp=2", "mesh.model=2", "sharding=fsdp_tp"], []),
        # Expert parallelism: 2 of the 4 experts per process, tokens sent to them by all-to-all,
        # the experts' weights also split over fsdp, or replicated over data.
        (4, ["mesh.fsdp=2", "mesh.expert=2", "sharding=fsdp_ep"], []),
        # With a capacity, each of the 4 replicas fills its experts' buffers from its own 2 rows,
        # as one device does from each of 4 accumulated micro-batches of those rows.
        (4, ["mesh.data=2", "mesh.expert=2", "sharding=fsdp_ep", CAPACITY], [CAPACITY, "trainer.grad_accum_steps=4"]),
    ],
    ids=["fsdp2_tp2", "fsdp2_ep2", "hsdp2_ep2_capacity"],
)
def test_mixture_of_experts_losses_match_a_single_device(processes, mesh, one_device, tmp_path, data_cache):
    cache = data_cache
    train_on_one_device(tmp_path / "single", cache, *MOE, *one_device)
    out = tmp_path / "distributed"
    run_ranks(processes, str(WORKER), str(out), str(STEPS), *debug_overrides(out, cache, "backend=native", *mesh, *MOE))
    single, distributed = train_losses(tmp_path / "single"), train_losses(out)
    assert len(single) == len(distributed) == STEPS
    torch.testing.assert_close(torch.tensor(distributed), torch.tensor(single), rtol=1e-5, atol=1e-5)
    # The checkpoint holds the same whole tensors, whichever process held which experts.
    step = f"step_{STEPS:08d}"
    expected = read_model_tensors(tmp_path / "single" / "checkpoints" / step)
    got = read_model_tensors(out / "checkpoints" / step)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)
