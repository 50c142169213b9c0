import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from axtorch.train.loss import IGNORE_INDEX, CrossEntropyLossConfig, LossInput, forward_with_loss


def test_cross_entropy_ignores_masked_tokens():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :2] = IGNORE_INDEX
    out = CrossEntropyLossConfig().build()(LossInput(logits, labels))
    expected = F.cross_entropy(logits.view(-1, 11), labels.view(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(out.loss, expected)
    assert int(out.num_tokens) == 8


def test_z_loss_adds_weighted_squared_log_partition():
    logits = torch.randn(3, 4, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (3, 4))
    out = CrossEntropyLossConfig(z_loss_weight=1e-2).build()(LossInput(logits, labels))
    expected_z = 1e-2 * torch.logsumexp(logits, -1).pow(2).mean()
    torch.testing.assert_close(out.z_loss, expected_z)
    torch.testing.assert_close(out.loss, out.cross_entropy + expected_z)


def test_global_token_count_normalises_micro_batches_to_the_full_batch_mean():
    logits = torch.randn(4, 6, 9, dtype=torch.float64)
    labels = torch.randint(0, 9, (4, 6))
    labels[1, 3:] = IGNORE_INDEX
    loss_fn = CrossEntropyLossConfig().build()
    full = loss_fn(LossInput(logits, labels)).loss
    total = (labels != IGNORE_INDEX).sum()
    parts = sum(
        loss_fn(LossInput(logits[i : i + 1], labels[i : i + 1], num_target_tokens=total)).loss for i in range(4)
    )
    torch.testing.assert_close(parts, full)


def test_bf16_logits_are_reduced_in_float32():
    logits = torch.randn(1, 4, 5).bfloat16()
    out = CrossEntropyLossConfig().build()(LossInput(logits, torch.zeros(1, 4, dtype=torch.long)))
    assert out.loss.dtype == torch.float32 and math.isfinite(float(out.loss))


def _losses_and_grads(chunk_size, *, z_loss_weight, bias, tied, num_targets=None, compiled_head=False):
    """The loss and the gradients of every parameter, from a tiny model with the head fused or not."""
    from axtorch.compose.experiment_loader import load_experiment_config

    torch.manual_seed(0)
    overrides = ["experiment=debug", "model.decoder.num_layers=1", f"model.tie_embeddings={tied}"]
    model = load_experiment_config([*overrides, f"model.lm_head.bias={bias}"]).model.build()
    model.init_weights()
    ids = torch.randint(0, model.config.vocab_size, (3, 11))
    labels = torch.randint(0, model.config.vocab_size, (3, 11))
    labels[0, :4] = IGNORE_INDEX
    loss_fn = CrossEntropyLossConfig(z_loss_weight=z_loss_weight, chunk_size=chunk_size).build(compiled_head)
    loss, _ = forward_with_loss(model, loss_fn, ids, labels, num_targets)
    (loss.loss * 3.0).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss, grads


@pytest.mark.parametrize("tied, bias, z_loss_weight", [(False, False, 0.0), (False, True, 1e-2), (True, False, 1e-2)])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_the_fused_head_and_loss_give_the_losses_and_gradients_of_whole_logits(chunk_size, tied, bias, z_loss_weight):
    expected, expected_grads = _losses_and_grads(None, z_loss_weight=z_loss_weight, bias=bias, tied=tied)
    got, grads = _losses_and_grads(chunk_size, z_loss_weight=z_loss_weight, bias=bias, tied=tied)
    for field in ("loss", "cross_entropy", "z_loss", "num_tokens"):
        torch.testing.assert_close(getattr(got, field), getattr(expected, field), rtol=1e-6, atol=1e-7)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_fused_loss_divides_by_the_global_token_count():
    count = torch.tensor(50)
    expected, expected_grads = _losses_and_grads(None, z_loss_weight=0.0, bias=False, tied=False, num_targets=count)
    got, grads = _losses_and_grads(5, z_loss_weight=0.0, bias=False, tied=False, num_targets=count)
    torch.testing.assert_close(got.loss, expected.loss)
    torch.testing.assert_close(grads["lm_head.weight"], expected_grads["lm_head.weight"], rtol=1e-5, atol=1e-7)


def _chunked_head_loss(hidden, weight, labels, normalizer):
    """The fused head loss over chunks of 4 rows, without z-loss or bias."""
    from axtorch.train.head_cross_entropy import head_cross_entropy

    return head_cross_entropy(
        hidden,
        weight,
        None,
        labels,
        ignore_index=IGNORE_INDEX,
        z_loss_weight=0.0,
        normalizer=torch.tensor(normalizer),
        chunk_size=4,
    )


def test_the_fused_loss_under_no_grad_computes_no_gradients():
    hidden, weight = torch.randn(6, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    labels = torch.tensor([1, 2, IGNORE_INDEX, 4, 5, 8])
    with torch.no_grad():
        loss, cross_entropy, _ = _chunked_head_loss(hidden, weight, labels, normalizer=5)
    expected = F.cross_entropy(hidden @ weight.T, labels, ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(cross_entropy, expected)
    assert not loss.requires_grad


class _OutputShapes(TorchDispatchMode):
    """Records the shape of every tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes.update(tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("head_trains", [False, True])
def test_a_frozen_head_gets_no_gradient_computed(head_trains):
    """LoRA freezes the head (a tied embedding): its [vocab, dim] gradient would cost memory and a matmul."""
    vocab, dim = 37, 5
    hidden, weight = torch.randn(11, dim, requires_grad=True), torch.randn(vocab, dim, requires_grad=head_trains)
    labels = torch.tensor([1, 2, IGNORE_INDEX, 4, 5, 8, 36, 0, 3, 3, 9])
    with _OutputShapes() as recorded:
        loss, _, _ = _chunked_head_loss(hidden, weight, labels, normalizer=10)
        loss.backward()
    assert ((vocab, dim) in recorded.shapes) == head_trains
    assert (weight.grad is not None) == head_trains
    reference = hidden.detach().requires_grad_()
    F.cross_entropy(reference @ weight.detach().T, labels, ignore_index=IGNORE_INDEX).backward()
    torch.testing.assert_close(hidden.grad, reference.grad)


def test_a_chunk_size_that_is_not_positive_is_refused():
    from axtorch.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"loss\.chunk_size"):
        CrossEntropyLossConfig(chunk_size=0).validate()
