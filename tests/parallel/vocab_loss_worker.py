"""Run on 2 ranks by test_vocab_parallel_loss.py: the fused head loss with a head split over its
vocabulary rows against the same loss with the head whole, on every rank.

    vocab_loss_worker.py VOCAB BIAS(0|1)

Exits non-zero, with the difference, if the losses or any gradient differ.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from axtorch.train.head_cross_entropy import head_cross_entropy
from axtorch.train.loss import IGNORE_INDEX


def losses_and_grads(hidden, weight, bias, labels):
    hidden = hidden.detach().requires_grad_()
    loss, cross_entropy, z_loss = head_cross_entropy(
        hidden,
        weight,
        bias,
        labels,
        ignore_index=IGNORE_INDEX,
        z_loss_weight=1e-2,
        normalizer=(labels != IGNORE_INDEX).sum(),
        chunk_size=16,
    )
    loss.backward()
    return (loss, cross_entropy, z_loss), hidden.grad


def main() -> None:
    vocab, with_bias = int(sys.argv[1]), sys.argv[2] == "1"
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("model",))
    generator = torch.Generator().manual_seed(0)  # the same tensors on every rank
    hidden = torch.randn(37, 8, generator=generator)
    labels = torch.randint(0, vocab, (37,), generator=generator)
    labels[[3, 20, 21]] = IGNORE_INDEX
    weight = torch.randn(vocab, 8, generator=generator).requires_grad_()
    bias = torch.randn(vocab, generator=generator).requires_grad_() if with_bias else None

    expected, expected_hidden = losses_and_grads(hidden, weight, bias, labels)
    split_weight = distribute_tensor(weight.detach(), mesh, [Shard(0)]).requires_grad_()
    split_bias = None if bias is None else distribute_tensor(bias.detach(), mesh, [Shard(0)]).requires_grad_()
    got, got_hidden = losses_and_grads(hidden, split_weight, split_bias, labels)

    for name, a, b in zip(("loss", "cross_entropy", "z_loss"), got, expected):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(got_hidden, expected_hidden, msg=lambda m: f"hidden's gradient: {m}")
    assert split_weight.grad.placements == (Shard(0),), split_weight.grad.placements  # never gathered
    torch.testing.assert_close(split_weight.grad.full_tensor(), weight.grad, msg=lambda m: f"head's gradient: {m}")
    if bias is not None:
        torch.testing.assert_close(split_bias.grad.full_tensor(), bias.grad, msg=lambda m: f"bias's gradient: {m}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
