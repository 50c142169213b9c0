import math

import torch
import torch.nn.functional as F

from axtorch.train.loss import IGNORE_INDEX, CrossEntropyLossConfig, LossInput


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
