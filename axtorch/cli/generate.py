"""``axtorch-generate``: load a checkpoint and continue a prompt.

    axtorch-generate checkpoint=runs/quickstart prompt="def main(" max_new_tokens=64
    axtorch-generate checkpoint=runs/quickstart/checkpoints/step_00000250 prompt="import " sampling.temperature=0.8

``checkpoint`` is a checkpoint directory or a run directory (its newest checkpoint is used); the
model config and tokenizer come from the run directory the checkpoint belongs to.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from axtorch.compose.experiment import check_keys_exist
from axtorch.config.errors import ConfigError
from axtorch.config.serialize import config_from_yaml, to_object
from axtorch.data.tokenizer import Tokenizer
from axtorch.infer.generate import generate
from axtorch.infer.sampling import SamplingConfig
from axtorch.parallel.single import resolve_device
from axtorch.train.checkpoint import checkpoint_problems, newest_valid_checkpoint, read_model_tensors
from axtorch.train.checkpoint_manifest import CheckpointError
from axtorch.train.experiment import ExperimentConfig
from axtorch.train.trainer import CONFIG_FILE, TOKENIZER_FILE


@dataclass
class GenerateConfig:
    checkpoint: str = MISSING
    prompt: str = MISSING
    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    device: str = "auto"


def resolve_checkpoint(path: Path) -> tuple[Path, Path]:
    """(checkpoint directory, run directory) for a checkpoint or run directory; only a verified checkpoint."""
    if (path / "model.safetensors.index.json").is_file():
        if problems := checkpoint_problems(path):
            raise CheckpointError(f"checkpoint {path} failed verification: {'; '.join(problems[:3])}")
        return path, path.parent.parent
    checkpoint = newest_valid_checkpoint(path / "checkpoints")
    if checkpoint is None:
        raise ConfigError(
            "checkpoint", str(path), "a run directory with checkpoints/ or a checkpoints/step_* directory"
        )
    return checkpoint, path


def load_model(checkpoint: Path, device: torch.device):
    """The trained model and its tokenizer, rebuilt from the run directory's config.yaml."""
    checkpoint, run_dir = resolve_checkpoint(checkpoint)
    config = config_from_yaml((run_dir / CONFIG_FILE).read_text(), ExperimentConfig)
    with torch.device("meta"):
        model = config.model.build()
    model.load_state_dict(read_model_tensors(checkpoint), strict=True, assign=True)
    tokenizer = Tokenizer.load(run_dir / TOKENIZER_FILE, config.data.tokenizer.eos_token)
    return model.to(device).eval(), tokenizer


def parse_args(argv: list[str]) -> GenerateConfig:
    schema = OmegaConf.structured(GenerateConfig)
    check_keys_exist(schema, argv)
    try:
        config = to_object(OmegaConf.merge(schema, OmegaConf.from_dotlist(argv)), GenerateConfig)
    except OmegaConfBaseException as error:
        raise ConfigError(
            getattr(error, "full_key", "?") or "?",
            argv,
            "values of the declared types",
            reason=str(error).splitlines()[0],
        ) from error
    config.sampling.validate("sampling")
    return config


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
        model, tokenizer = load_model(Path(config.checkpoint), resolve_device(config.device, "device"))
    except (ConfigError, CheckpointError) as error:
        print(f"axtorch-generate: {error}", file=sys.stderr)
        return 2
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(config.seed)
    ids = generate(
        model,
        tokenizer.encode(config.prompt),
        config.max_new_tokens,
        config.sampling,
        eos_id=tokenizer.eos_id,
        generator=generator,
    )
    print(config.prompt + tokenizer.decode(ids))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
