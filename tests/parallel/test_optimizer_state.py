"""AdamW's state made ahead of its first step (``create_adamw_state``) is what that step makes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from axtorch.parallel.optimizer_state import create_adamw_state
from axtorch.train.optimizer import OptimConfig, build_optimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    model[0].bias.requires_grad_(False)  # a frozen parameter gets no state
    return model


def _layout(tensor: torch.Tensor) -> tuple:
    return tensor.shape, tensor.dtype, tensor.device, tensor.stride()


@pytest.mark.parametrize(
    "options",
    [{}, {"amsgrad": True}, {"fused": None, "foreach": True}, {"fused": None, "foreach": False}, {"weight_decay": 0.0}],
    ids=["axtorch_fused", "amsgrad", "foreach", "for_loop", "no_decay"],
)
def test_the_state_is_the_one_adamws_first_step_makes_with_the_parameters_unchanged(options):
    made, stepped = _model(), _model()
    optimizers = []
    for model in (made, stepped):
        optimizer = build_optimizer(model, OptimConfig(lr=0.5, weight_decay=0.1))
        for group in optimizer.param_groups:
            group.update(options)
        optimizers.append(optimizer)
    before = {name: p.detach().clone() for name, p in made.named_parameters()}
    created = create_adamw_state(optimizers[0])
    stepped(torch.ones(2, 4)).sum().backward()
    optimizers[1].step()

    assert {id(p) for p in created} == {id(p) for p in made.parameters() if p.requires_grad}
    for (name, param), other in zip(made.named_parameters(), stepped.parameters()):
        torch.testing.assert_close(param, before[name], rtol=0, atol=0)
        ours, theirs = optimizers[0].state.get(param, {}), optimizers[1].state.get(other, {})
        assert ours.keys() == theirs.keys(), name
        for key, value in ours.items():
            assert _layout(value) == _layout(theirs[key]), (name, key)
            assert not value.any(), (name, key)


def test_a_parameter_with_state_keeps_it_and_another_optimizer_is_refused():
    model = _model()
    optimizer = build_optimizer(model, OptimConfig())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    state = {param: dict(values) for param, values in optimizer.state.items()}
    assert not create_adamw_state(optimizer)
    assert all(optimizer.state[param]["step"] == values["step"] for param, values in state.items())
    with pytest.raises(TypeError, match="not SGD's"):
        create_adamw_state(torch.optim.SGD(model.parameters(), lr=0.1))
