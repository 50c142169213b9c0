"""A trained run's model and tokenizer, from its ``config.yaml`` and a verified checkpoint.

What ``axtorch-generate checkpoint=`` and ``axtorch-export checkpoint=`` read. A run that trained
adapters (``model/adapter``) saved only those: its base is rebuilt from where the run took it
(``init_from``, or the seed), checked against the recorded digest, and the adapters are merged
into it, so what comes back is a plain model of the configured architecture.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from axtorch.config.errors import ConfigError
from axtorch.config.serialize import config_from_yaml
from axtorch.data.tokenizer import Tokenizer
from axtorch.interop.pretrained import load_pretrained
from axtorch.models.causal_lm import CausalLM
from axtorch.models.transforms import restore_model_transforms
from axtorch.parallel.single import SingleDeviceBackend
from axtorch.train.adapters import base_digest, check_base
from axtorch.train.checkpoint import (
    checkpoint_problems,
    load_model,
    newest_valid_checkpoint,
    read_model_tensors,
    read_trainer_state,
)
from axtorch.train.checkpoint_manifest import CheckpointError
from axtorch.train.experiment import ExperimentConfig
from axtorch.train.run_layout import CHECKPOINTS_DIR, CONFIG_FILE, TOKENIZER_FILE


def resolve_checkpoint(path: Path) -> tuple[Path, Path]:
    """(checkpoint directory, run directory) for a checkpoint or run directory; only a verified checkpoint."""
    if (path / "model.safetensors.index.json").is_file():
        if problems := checkpoint_problems(path):
            raise CheckpointError(f"checkpoint {path} failed verification: {'; '.join(problems[:3])}")
        return path, path.parent.parent
    checkpoint = newest_valid_checkpoint(path / CHECKPOINTS_DIR)
    if checkpoint is None:
        raise ConfigError(
            "checkpoint", str(path), "a run directory with checkpoints/ or a checkpoints/step_* directory"
        )
    return checkpoint, path


def load_trained_model(checkpoint: Path, device: torch.device) -> tuple[CausalLM, Tokenizer]:
    """The trained model and its tokenizer, rebuilt from the run directory's config.yaml."""
    checkpoint, run_dir = resolve_checkpoint(checkpoint)
    config = config_from_yaml((run_dir / CONFIG_FILE).read_text(), ExperimentConfig)
    if config.model.adapter is not None:
        model = _adapted_base(config, checkpoint)
    else:
        with torch.device("meta"):
            model = config.model.build()
        model.load_state_dict(read_model_tensors(checkpoint), strict=True, assign=True)
    tokenizer = Tokenizer.load(run_dir / TOKENIZER_FILE, config.data.tokenizer.eos_token)
    return model.to(device).eval(), tokenizer


def _adapted_base(config: ExperimentConfig, checkpoint: Path) -> CausalLM:
    """The run's base with its checkpoint's adapters merged in, on the CPU."""
    from axtorch.train.trainer import build_parallel_model  # the trainer's own way to build the start

    check_base(read_trainer_state(checkpoint), base_digest(config), checkpoint)
    with tempfile.TemporaryDirectory() as scratch:
        pretrained = load_pretrained(config.init_from, Path(scratch)) if config.init_from else None
        model = build_parallel_model(config, SingleDeviceBackend(torch.device("cpu")), pretrained)
    load_model(checkpoint, model)  # the adapters: every parameter that trained
    # Back to the model's own layers, the adapters merged into the weights they trained with (an int8
    # base's dequantised ones, a float8 base's full-precision ones)
    restore_model_transforms(config.model.transforms(), model)
    return model
