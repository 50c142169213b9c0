"""The optimizer state made before a first step (``create_state``), as the dry run traces it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from axtorch.train.optimizer import OptimConfig, build_optimizer, create_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    model[0].bias.requires_grad_(False)  # a frozen parameter gets no state
    return model


def test_the_state_is_adamws_own_and_nothing_else_changes():
    model = _model()
    optimizer = build_optimizer(model, OptimConfig(lr=0.5, weight_decay=0.1))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    create_state(optimizer)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, before[name], rtol=0, atol=0)  # lr 0: weight decay too
        assert param.grad is None, name
        state = optimizer.state.get(param, {})
        if param.requires_grad:
            assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, name
            assert state["exp_avg"].shape == param.shape and not state["exp_avg"].any()
        else:
            assert not state, name
    assert [group["lr"] for group in optimizer.param_groups] == [0.5, 0.5]


def test_an_optimizer_that_has_stepped_is_refused():
    model = _model()
    optimizer = build_optimizer(model, OptimConfig())
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(ValueError, match="has not stepped"):
        create_state(optimizer)
    optimizer.step()
    optimizer.zero_grad()
    with pytest.raises(ValueError, match="has not stepped"):
        create_state(optimizer)
