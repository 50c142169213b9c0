"""A trained run's model and tokenizer, from its ``config.yaml`` and a verified checkpoint.

What ``axtorch-generate checkpoint=`` and ``axtorch-export checkpoint=`` read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from axtorch.config.errors import ConfigError
from axtorch.config.serialize import config_from_yaml
from axtorch.data.tokenizer import Tokenizer
from axtorch.models.causal_lm import CausalLM
from axtorch.train.checkpoint import checkpoint_problems, newest_valid_checkpoint, read_model_tensors
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
    with torch.device("meta"):
        model = config.model.build()
    model.load_state_dict(read_model_tensors(checkpoint), strict=True, assign=True)
    tokenizer = Tokenizer.load(run_dir / TOKENIZER_FILE, config.data.tokenizer.eos_token)
    return model.to(device).eval(), tokenizer
