"""``axtorch-train``: compose the experiment config with Hydra, validate it, train.

Examples::

    axtorch-train                                   # the quickstart experiment on the stdlib corpus
    axtorch-train experiment=debug trainer.max_steps=50
    axtorch-train model/ffn=gelu optim.lr=1e-3 run_dir=runs/gelu
    axtorch-train --config-dir ~/my_conf experiment=mine   # a user's own experiments and presets
    torchrun --standalone --nproc-per-node 4 -m axtorch.train backend=native mesh.fsdp=4 sharding=fsdp
"""

from __future__ import annotations

import sys

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from axtorch.cli.key_values import HELP_FLAGS
from axtorch.compose.experiment_loader import (
    CONFIG_MODULE,
    PRIMARY_CONFIG,
    compose_experiment_config,
    describe_auto_sharding,
    model_from_file,
    resolve_choices,
    to_experiment_config,
)
from axtorch.compose.registry import register_configs
from axtorch.config.errors import ConfigError
from axtorch.parallel.shutdown import exit_process
from axtorch.train.checkpoint_manifest import CheckpointError
from axtorch.train.exit_codes import ExitCode, process_exit_code
from axtorch.train.numerics import NonFiniteError
from axtorch.train.preemption import PreemptionWatch
from axtorch.train.run_layout import SUMMARY
from axtorch.train.trainer import Trainer, TrainResult

#: Hydra's own flags that take a value as the next argument.
_FLAGS_WITH_VALUE = (
    "--config-dir",
    "-cd",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--info",
    "-i",
    "--experimental-rerun",
)


def _fail(error: Exception, code: ExitCode, ran_collectives: bool = False) -> None:
    print(f"axtorch-train: {error}", file=sys.stderr)
    exit_process(int(code), ran_collectives)


def _train(cfg: DictConfig, preemption: PreemptionWatch) -> None:
    ran_collectives = False  # whether this process joined a process group (see exit_process)
    try:
        trainer = Trainer(to_experiment_config(cfg))
        ran_collectives = dist.is_available() and dist.is_initialized()
        try:
            result = trainer.fit(preemption=preemption)
        finally:
            trainer.backend.close()
    except ConfigError as error:  # also raised by fit(), e.g. resuming checkpoints of another model
        _fail(error, ExitCode.CONFIG_ERROR, ran_collectives)
    except CheckpointError as error:  # nothing to resume from, a failed save
        _fail(error, ExitCode.FAILED, ran_collectives)
    except NonFiniteError as error:
        _fail(error, ExitCode.NON_FINITE, ran_collectives)
    code = ExitCode.PREEMPTED if result.preempted_by else ExitCode.FINISHED
    if trainer.backend.is_main_process:
        _report(result, code)
    if code or ran_collectives:
        exit_process(process_exit_code(code), ran_collectives or code is ExitCode.PREEMPTED)


def _report(result: TrainResult, code: ExitCode) -> None:
    if result.preempted_by:
        newest = result.checkpoint or "none yet (no step had been trained)"
        print(
            f"preempted by {result.preempted_by} at step {result.step}: newest checkpoint {newest}; "
            f"exit {int(code)} (resume me): run the same command to resume"
        )
        return
    start = f"{result.initial_eval_loss:.4f} -> " if result.initial_eval_loss is not None else ""
    final = f"{result.final_eval_loss:.4f}" if result.final_eval_loss is not None else "n/a (no held-out data)"
    print(f"done: step {result.step}, held-out loss {start}{final}")
    print(f"run directory: {result.run_dir} ({SUMMARY})")


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """(overrides, users' config directories) of an ``axtorch-train`` command line."""
    overrides, config_dirs = [], []
    args = iter(argv)
    for arg in args:
        flag, has_value, value = arg.partition("=")
        if flag in ("--config-dir", "-cd"):
            config_dirs.append(value if has_value else next(args, ""))
        elif arg in _FLAGS_WITH_VALUE:
            next(args, None)
        elif not arg.startswith("-"):
            overrides.append(arg)
    return overrides, config_dirs


def main() -> None:
    # Entered first, so that a preemption signal during start-up stops the run before its first
    # step instead of killing it, and held until the process exits (axtorch/train/preemption.py).
    with PreemptionWatch(until_exit=True) as preemption:
        register_configs()
        overrides, config_dirs = split_arguments(sys.argv[1:])
        if any(arg.split("=", 1)[0] == "dry_run" for arg in overrides):
            from axtorch.cli.dry_run import run_dry  # its tracing tools load only for a dry run

            raise SystemExit(run_dry(overrides, config_dirs))
        try:
            # --help: Hydra's, listing the config groups and every key of the composed config.
            if not {"-m", "--multirun", *HELP_FLAGS} & set(sys.argv):
                # Strict keys and clear errors before Hydra runs; then the mesh rule's overrides join the
                # command line, so that the config Hydra composes is the one checked here.
                composed = compose_experiment_config(overrides, config_dirs, apply_mesh_rules=False)
                chosen, composed = resolve_choices(overrides, composed, config_dirs)
                if chosen != overrides:  # a rule or sharding=auto chose: hand Hydra the overrides checked here
                    flags = [arg for arg in sys.argv[1:] if arg not in overrides]
                    sys.argv = [sys.argv[0], *flags, *chosen]
                if composed.mesh_rules.selected:
                    print(f"mesh rule {composed.mesh_rules.selected!r} for hardware {composed.mesh_rules.hardware}")
                if composed.sharding.auto:
                    print(f"sharding=auto: {describe_auto_sharding(composed)}")

            def train(cfg: DictConfig) -> None:
                hydra_run = HydraConfig.get()  # what Hydra composed: the model is init_from's when none was chosen
                try:
                    cfg = model_from_file(cfg, list(hydra_run.overrides.task), dict(hydra_run.runtime.choices))
                except ConfigError as error:
                    _fail(error, ExitCode.CONFIG_ERROR)
                _train(cfg, preemption)

            hydra.main(version_base=None, config_path=f"pkg://{CONFIG_MODULE}", config_name=PRIMARY_CONFIG)(train)()
        except ConfigError as error:
            _fail(error, ExitCode.CONFIG_ERROR)


if __name__ == "__main__":
    main()
