import math

import pytest

from axtorch.train.schedule import ScheduleConfig, ScheduleKind, learning_rate


def test_warmup_is_linear_to_the_peak():
    config = ScheduleConfig(kind=ScheduleKind.cosine, warmup_steps=10)
    assert learning_rate(config, 1.0, 0, 100) == pytest.approx(0.1)
    assert learning_rate(config, 1.0, 9, 100) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kind, midpoint", [(ScheduleKind.cosine, 0.55), (ScheduleKind.linear, 0.55), (ScheduleKind.constant, 1.0)]
)
def test_decay_shapes(kind, midpoint):
    config = ScheduleConfig(kind=kind, warmup_steps=0, min_lr_ratio=0.1)
    assert learning_rate(config, 1.0, 0, 100) == pytest.approx(1.0)
    assert learning_rate(config, 1.0, 50, 100) == pytest.approx(midpoint)
    end = learning_rate(config, 1.0, 100, 100)
    assert end == pytest.approx(1.0 if kind is ScheduleKind.constant else 0.1)


def test_cosine_follows_the_formula():
    config = ScheduleConfig(warmup_steps=10, min_lr_ratio=0.0)
    lr = learning_rate(config, 2.0, 35, 110)
    assert lr == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 25 / 100)))
