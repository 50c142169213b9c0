"""The fused head loss on a head split over its vocabulary (tensor parallelism) equals the loss on
the whole head: losses, z-loss, and the hidden states', head's and bias's gradients, on 2 gloo
ranks; the head's gradient stays split. The training runs under ``mesh.model`` in
test_native_backend.py hold the same to one device's losses over several steps."""

from pathlib import Path

import pytest
from forked_ranks import run_ranks

pytestmark = pytest.mark.journey

WORKER = Path(__file__).with_name("vocab_loss_worker.py")


# 11 rows split 6 + 5 (uneven, as DTensor splits them); 12 split evenly, with a bias.
@pytest.mark.parametrize("vocab, bias", [(11, "0"), (12, "1")], ids=["uneven", "even-with-bias"])
def test_a_vocabulary_parallel_head_loss_equals_the_whole_heads(vocab, bias):
    run_ranks(2, str(WORKER), str(vocab), bias)
