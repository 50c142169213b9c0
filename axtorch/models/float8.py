"""Float8 training of a model's linear layers, through torchao (``model/float8=tensorwise|rowwise``).

A model transform (``axtorch.models.transforms``), applied to a built model from outside its
layers, as sharding is: ``Float8Linears.apply`` swaps each eligible ``Linear`` for torchao's
``Float8Linear``, which keeps the same ``weight`` and ``bias`` parameters (so checkpoints,
sharding rules and HF export are unchanged) and runs its matmuls in float8 with dynamic scales:
one per tensor (``tensorwise``) or one per row (``rowwise``, more accurate, needs torch's per-row
``_scaled_mm``). The trainer applies it before
sharding, so FSDP gathers the high-precision weights and torchao scales the whole weight, as on
one device. Inference from such a run uses ordinary linears.

With adapters (``model/adapter=lora``, applied first) the frozen base runs in float8 and its
adapters in full precision: a converted linear keeps its ``adapter`` child (so its parameter
names), which is not a ``Linear`` and so never converts, and a forward hook adds its output as
``Linear.forward`` does, since torchao's forward is not ours to compose into.

The speed-up needs float8 tensor cores (compute capability 8.9+: Ada, Hopper). The device the
model trains on decides, not whether the machine has a GPU: elsewhere (the CPU, an older GPU, XLA)
tensorwise's float8 matmuls are emulated by torchao (the same float8 values and scales, multiplied
in float32, with the kernel's results; torch's CPU ``_scaled_mm`` is a reference kernel ~1000x
slower), and rowwise runs that CPU kernel, slowly, where torch has one (2.10+) and refuses
otherwise: enough to check that the recipes compose with FSDP and how far the loss moves.
torchao is an optional dependency (``pip install 'axtorch[float8]'``; torchao 0.14 with torch 2.9,
newer with newer torch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.layers.linear import Linear, LinearConfig, plus_adapter
from axtorch.models.transforms import ModelTransformConfig, replace_submodule

#: torchao's float8 matmul needs both dimensions of every weight divisible by this.
_FLOAT8_MULTIPLE = 16


@dataclass
class Float8Config(ModelTransformConfig):
    """Slot type for ``model.float8``; None (the default) trains every linear in its own dtype."""

    #: torchao's recipe name, set by each option.
    recipe: ClassVar[str] = ""
    #: Linears whose qualified name contains one of these stay in high precision. The head's
    #: logits feed the loss directly, and the router's choice is discrete, so both are sensitive.
    skip: list[str] = field(default_factory=lambda: ["lm_head", "router"])

    def build(self, device: torch.device) -> Float8Linears:
        return Float8Linears(self, device)


@dataclass
class TensorwiseFloat8Config(Float8Config):
    """One dynamic scale per tensor: the fastest recipe, and the one torch's CPU matmul supports everywhere."""

    recipe: ClassVar[str] = "tensorwise"


@dataclass
class RowwiseFloat8Config(Float8Config):
    """One dynamic scale per row: closer to bf16 than tensorwise, on CPU only from torch 2.10."""

    recipe: ClassVar[str] = "rowwise"

    def validate(self, key: str = "model.float8") -> None:
        """Without a GPU the model trains on the CPU, known before any compute; ``build`` checks the device in use."""
        if not torch.cuda.is_available():
            _check_rowwise_runs_on(torch.device("cpu"), key)


def has_float8_matmul(device: torch.device) -> bool:
    """Whether ``device`` multiplies float8 in hardware: a GPU of compute capability 8.9 or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _check_rowwise_runs_on(device: torch.device, key: str = "model.float8") -> None:
    if has_float8_matmul(device):
        return
    if device.type == "cuda":
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ConfigError(
            key,
            "rowwise",
            "tensorwise (emulated) on a GPU without float8 tensor cores",
            reason=f"{torch.cuda.get_device_name(device)} (compute capability {capability}) has no float8 matmul",
        )
    if torch.__version__ < "2.10":  # TorchVersion: compares as versions
        raise ConfigError(
            key,
            "rowwise",
            "tensorwise on a CPU with torch < 2.10",
            reason=f"torch {torch.__version__}'s CPU float8 matmul takes one scale per tensor only",
        )


class Float8Linears:
    """A ``ModelTransform``: a model's eligible ``Linear`` layers become torchao's float8 training linears."""

    def __init__(self, config: Float8Config, device: torch.device):
        if config.recipe == "rowwise":
            _check_rowwise_runs_on(device)
        self.config = config
        self.device = device

    def eligible(self, name: str, module: nn.Module) -> bool:
        """A ``Linear`` whose name is not skipped and whose weight float8 matmuls can take."""
        return (
            isinstance(module, Linear)
            and not any(part in name for part in self.config.skip)
            and module.in_features % _FLOAT8_MULTIPLE == 0
            and module.out_features % _FLOAT8_MULTIPLE == 0
        )

    def apply(self, model: nn.Module) -> list[str]:
        """Swap in place (works on the meta device); returns the converted linears' names."""
        linear_class, torchao_config = _torchao_float8(self.config.recipe, emulate=not has_float8_matmul(self.device))
        converted = [name for name, module in model.named_modules() if self.eligible(name, module)]
        for name in converted:
            linear = model.get_submodule(name)
            float8_linear = linear_class.from_float(linear, config=torchao_config)
            if linear.adapter is not None:  # a LoRA on a frozen base: same child, same names, full precision
                float8_linear.adapter = linear.adapter
                float8_linear.register_forward_hook(_add_adapter_output)
            replace_submodule(model, name, float8_linear)
        return converted

    def restore(self, model: nn.Module) -> list[str]:
        """Every float8 linear back to a ``Linear`` holding the same ``weight``, ``bias`` and adapter:
        the full-precision function it trained (export and inference read plain linears)."""
        linear_class, _ = _torchao_float8(self.config.recipe, emulate=not has_float8_matmul(self.device))
        restored = [name for name, module in model.named_modules() if isinstance(module, linear_class)]
        for name in restored:
            float8_linear = cast(nn.Linear, model.get_submodule(name))  # torchao's subclasses nn.Linear
            with torch.device("meta"):
                config = LinearConfig(bias=float8_linear.bias is not None)
                linear = Linear(config, float8_linear.in_features, float8_linear.out_features)
            linear.weight, linear.bias = cast(nn.Parameter, float8_linear.weight), float8_linear.bias
            linear.adapter = getattr(float8_linear, "adapter", None)
            replace_submodule(model, name, linear)
        return restored


def _add_adapter_output(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    """A forward hook on torchao's linear, whose forward axtorch does not write: ``plus_adapter``."""
    return plus_adapter(module, args[0], output)


def _torchao_float8(recipe: str, emulate: bool) -> tuple[Any, Any]:
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as error:
        raise ConfigError(
            "model.float8",
            recipe,
            "none, or install torchao (pip install 'axtorch[float8]')",
            reason=f"float8 training runs through torchao, which does not import here: {error}",
        ) from error
    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise" and emulate:
        # An older GPU has no float8 matmul, and torch's CPU _scaled_mm is a reference kernel, ~1000x
        # slower than a float32 matmul of the same inputs (1.9 s for 1024x256 @ 256x256 on one
        # thread, torch 2.9 and 2.13). torchao's emulation multiplies the same float8 values with
        # their scales in float32, as the kernel does for tensorwise; rowwise's kernel output passes
        # through bf16 (torchao's workaround), which the emulation would skip, so rowwise keeps the kernel.
        config = dataclasses.replace(config, emulate=True)
    return Float8Linear, config
