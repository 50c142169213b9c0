"""``axtorch-train``: compose the experiment config with Hydra, validate it, train.

Examples::

    axtorch-train                                   # the quickstart experiment on the stdlib corpus
    axtorch-train experiment=debug trainer.max_steps=50
    axtorch-train model/ffn=gelu optim.lr=1e-3 run_dir=runs/gelu
    torchrun --standalone --nproc-per-node 4 -m axtorch.train backend=native mesh.fsdp=4 sharding=fsdp
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from axtorch.compose.experiment import PRIMARY_CONFIG, check_overrides, conf_dir, to_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.compose.registry import register_configs
from axtorch.train.trainer import Trainer


def _fail(error: ConfigError) -> None:
    print(f"axtorch-train: {error}", file=sys.stderr)
    raise SystemExit(2)


def _train(cfg: DictConfig) -> None:
    try:
        trainer = Trainer(to_experiment_config(cfg))
        try:
            result = trainer.fit()
        finally:
            trainer.backend.close()
    except ConfigError as error:  # also raised by fit(), e.g. resuming checkpoints of another model
        _fail(error)
    if not trainer.backend.is_main_process:
        return
    start = f"{result.initial_eval_loss:.4f} -> " if result.initial_eval_loss is not None else ""
    print(f"done: step {result.step}, held-out loss {start}{result.final_eval_loss or float('nan'):.4f}")
    print(f"run directory: {result.run_dir} (config.yaml, metrics.jsonl, tensorboard/, checkpoints/, loss.png)")


def main() -> None:
    register_configs()
    overrides = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
    try:
        if "-m" not in sys.argv and "--multirun" not in sys.argv:
            check_overrides(overrides)
        hydra.main(version_base=None, config_path=str(conf_dir()), config_name=PRIMARY_CONFIG)(_train)()
    except ConfigError as error:
        _fail(error)


if __name__ == "__main__":
    main()
