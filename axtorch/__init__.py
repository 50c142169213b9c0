"""axtorch: composable, config-driven LLM training in PyTorch.

The names below are what a script usually needs, each imported on first use
(``axtorch.config.lazy_exports``), so ``import axtorch`` stays cheap. Generation is
``from axtorch.infer import generate``: ``axtorch.generate`` is the ``python -m`` entry point.
"""

from typing import TYPE_CHECKING

from axtorch.config.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from axtorch.compose.experiment_loader import load_experiment_config
    from axtorch.infer.sampling import SamplingConfig
    from axtorch.interop.gguf import from_gguf
    from axtorch.interop.gguf_export import to_gguf
    from axtorch.interop.hf import from_hf, to_hf
    from axtorch.models.causal_lm import CausalLM, CausalLMConfig, CausalLMInput, CausalLMOutput
    from axtorch.parallel.factory import BackendKind, build_backend
    from axtorch.train.experiment import ExperimentConfig
    from axtorch.train.trained_model import load_trained_model
    from axtorch.train.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "BackendKind",
    "CausalLM",
    "CausalLMConfig",
    "CausalLMInput",
    "CausalLMOutput",
    "ExperimentConfig",
    "SamplingConfig",
    "Trainer",
    "build_backend",
    "from_gguf",
    "from_hf",
    "load_experiment_config",
    "load_trained_model",
    "to_gguf",
    "to_hf",
]

__getattr__ = lazy_exports(__name__, __file__)
