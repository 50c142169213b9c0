"""Expert parallelism's gathered experts are gathered again in the backward, not kept from the forward
(``axtorch/parallel/experts.py``): the same gradients, one gather per weight, and no reference left."""

import contextlib
import gc
import weakref

import torch

from axtorch.layers.feed_forward import Activation
from axtorch.layers.mixture_of_experts import gated_mlp
from axtorch.parallel.experts import _RegatheredInBackward


def _expert_outputs(params, rows, hooked: bool, gathers: list[int]):
    """Two local experts' products on their rows, with the weights whole as a gather leaves them."""
    whole = [param.clone() for param in params]  # a fresh tensor each, carrying gradients, as the gather's output
    roots = [weakref.ref(tensor) for tensor in whole]

    def gather(index: int) -> torch.Tensor:
        gathers.append(index)
        return params[index].detach().clone()

    hooks = _RegatheredInBackward(whole, gather)
    with hooks.installed() if hooked else contextlib.nullcontext():
        out = torch.cat(
            [gated_mlp(group, whole[0][e], whole[1][e], whole[2][e], Activation.silu) for e, group in enumerate(rows)]
        )
    del whole
    gc.collect()
    return out, [root() is None for root in roots]


def test_gathered_experts_are_gathered_again_in_the_backward_with_the_same_gradients():
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, 6, 4), (2, 6, 4), (2, 4, 6)]  # gate, up, down of 2 experts
    params = [torch.randn(shape, generator=generator, requires_grad=True) for shape in shapes]
    # The rows carry gradients, as the all-to-all hands them over: each product then saves its weight.
    rows = [torch.randn(n, 4, generator=generator, requires_grad=True) for n in (3, 5)]

    gathers: list[int] = []
    kept, kept_released = _expert_outputs(params, rows, hooked=False, gathers=gathers)
    kept.square().sum().backward()
    expected = [tensor.grad.clone() for tensor in (*params, *rows)]
    for tensor in (*params, *rows):
        tensor.grad = None

    regathered, released = _expert_outputs(params, rows, hooked=True, gathers=gathers)
    assert released == [True, True, True] and kept_released == [False, False, False]
    assert gathers == []  # nothing gathered before the backward
    torch.testing.assert_close(regathered, kept)
    regathered.square().sum().backward()
    assert sorted(gathers) == [0, 1, 2]  # once a weight, for all its experts' views
    for tensor, grad in zip((*params, *rows), expected):  # the weights' gradients and the rows'
        torch.testing.assert_close(tensor.grad, grad)


def test_under_remat_the_experts_are_left_to_the_recomputation():
    """Inside a checkpointed region nothing is kept for the backward (which runs the forward again,
    gathers included): the hooks stand aside, and checkpoint's own keep nothing of the experts."""
    generator = torch.Generator().manual_seed(0)
    params = [
        torch.randn(shape, generator=generator, requires_grad=True) for shape in [(2, 6, 4), (2, 6, 4), (2, 4, 6)]
    ]
    rows = [torch.randn(n, 4, generator=generator, requires_grad=True) for n in (3, 5)]
    gathers: list[int] = []

    def forward():
        return _expert_outputs(params, rows, hooked=True, gathers=gathers)[0]

    out = torch.utils.checkpoint.checkpoint(forward, use_reentrant=False)
    out.square().sum().backward()
    assert gathers == []  # the recomputed forward had its weights: nothing gathered again
    assert all(param.grad is not None for param in params)
