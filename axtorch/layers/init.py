"""Parameter initialisation as configuration: every parameterised layer names its scheme here."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


class InitScheme(enum.Enum):
    normal = "normal"
    truncated_normal = "truncated_normal"
    zeros = "zeros"
    ones = "ones"


@dataclass
class InitConfig:
    """How one parameter is initialised.

    ``truncated_normal`` cuts at +-2 std (the convention of Llama and AXLearn). Randomness
    comes from torch's global generator, so a seeded run initialises identically.
    """

    scheme: InitScheme = InitScheme.normal
    std: float = 0.02


@torch.no_grad()
def initialize(tensor: torch.Tensor, config: InitConfig) -> None:
    """Fill ``tensor`` in place according to ``config``."""
    if config.scheme is InitScheme.normal:
        tensor.normal_(0.0, config.std)
    elif config.scheme is InitScheme.truncated_normal:
        torch.nn.init.trunc_normal_(tensor, 0.0, config.std, -2 * config.std, 2 * config.std)
    elif config.scheme is InitScheme.zeros:
        tensor.zero_()
    elif config.scheme is InitScheme.ones:
        tensor.fill_(1.0)
    else:  # pragma: no cover - the enum is exhaustive
        raise ValueError(f"unknown init scheme {config.scheme}")


def initial_parameter_values(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter's initial value, full-size on the host, one module at a time.

    Every submodule's ``reset_parameters`` runs in module order on a host twin that holds only
    that module's own parameters (the contract: ``reset_parameters`` initialises the module's own
    parameters, not its children's). So a model still on the meta device, or already sharded, is
    initialised exactly as a whole model on the CPU would be under the same seed, and no more than
    one module's parameters are ever held in full.
    """
    for module_name, module in model.named_modules():
        reset = getattr(type(module), "reset_parameters", None)
        own = list(module.named_parameters(recurse=False))
        if reset is None or not own:
            continue
        # A shallow copy, made without calling the class: an FSDP-wrapped class's constructor
        # would run the module's __init__ again, without its arguments.
        twin = object.__new__(type(module))
        twin.__dict__.update(module.__dict__)
        object.__setattr__(twin, "_parameters", {})
        for name, param in own:
            twin.register_parameter(
                name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype), requires_grad=False)
            )
        reset(twin)
        prefix = f"{module_name}." if module_name else ""
        for name, value in twin.named_parameters(recurse=False):
            yield prefix + name, value.detach()


@torch.no_grad()
def initialize_parameters(model: nn.Module) -> None:
    """Initialise every parameter of ``model`` in place, with the values of ``initial_parameter_values``."""
    for name, value in initial_parameter_values(model):
        model.get_parameter(name).copy_(value)
