"""The training loop, written once for every backend: data, model, optimizer, evaluation, checkpoints, metrics.

Everything the loop touches comes from ``ExperimentConfig``; the loop itself knows nothing about which
layers the model is made of.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import math
import random
import resource
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from tqdm.auto import tqdm

from axtorch.config.errors import ConfigError
from axtorch.config.serialize import config_to_yaml, with_former_module_names
from axtorch.data.loader import Batch, DataModule, build_data
from axtorch.interop.pretrained import (
    Pretrained,
    check_same_architecture,
    load_pretrained,
    pretrained_tokenizer_path,
)
from axtorch.layers.init import initial_parameter_values
from axtorch.models.causal_lm import CausalLM
from axtorch.models.transforms import apply_model_transforms
from axtorch.parallel.backend import Backend, materialize
from axtorch.parallel.factory import build_backend
from axtorch.parallel.single import SingleDeviceBackend
from axtorch.train.adapters import BASE_DIGEST_KEY, base_digest, check_base, with_fresh_adapters
from axtorch.train.checkpoint import Checkpointer, list_checkpoints, read_trainer_state
from axtorch.train.checkpoint_manifest import CheckpointError
from axtorch.train.compile import CompileWatch, compile_choice, compile_layers
from axtorch.train.config import Precision, SaveErrorPolicy, TrainerConfig
from axtorch.train.experiment import ExperimentConfig
from axtorch.train.flops import layer_flops_per_token, mfu, model_flops_per_token
from axtorch.train.goodput import GoodputRecorder
from axtorch.train.metrics import MetricsLogger
from axtorch.train.numerics import NonFiniteError, NonFiniteGuard
from axtorch.train.optimizer import build_optimizer
from axtorch.train.peak_flops import resolve_peak_flops
from axtorch.train.preemption import PreemptionWatch
from axtorch.train.rng import capture_rng_state, restore_rng_state
from axtorch.train.run_layout import CHECKPOINTS_DIR, CONFIG_FILE, LOSS_PLOT_FILE, TOKENIZER_FILE
from axtorch.train.schedule import learning_rate
from axtorch.train.step import TrainStep
from axtorch.train.watchdog import Watchdog

T = TypeVar("T")


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    #: Held-out loss before the first step of this run directory (None when resumed past it).
    initial_eval_loss: Optional[float]
    final_eval_loss: Optional[float]
    checkpoint: Optional[Path]
    #: The signal (SIGTERM, SIGINT) that ended the run early, after saving ``checkpoint``.
    preempted_by: Optional[str] = None


def config_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_model(config: ExperimentConfig, device: torch.device) -> CausalLM:
    """One unsharded, initialised model on ``device``: the trainer's weights for the same seed."""
    return build_parallel_model(config, SingleDeviceBackend(device))


def build_parallel_model(
    config: ExperimentConfig, backend: Backend, pretrained: Optional[Pretrained] = None, fill: bool = True
) -> CausalLM:
    """Build on the meta device, shard with ``backend``, then fill the shards one parameter at a time.

    The values are the seeded initialisation or ``pretrained``'s weights. A seeded start never
    holds the whole model in one process (only one module's parameters at a time); an import
    still does, in ``pretrained``, whose parameters are released one by one as they are copied.
    Without ``fill`` the shards are allocated and left unset: a dry run's fake tensors hold no values.
    """
    transforms = config.model.transforms()
    # Outside a dry run's fake mode: its parameters could not leave the meta device (``to_empty``).
    with torch.device("meta"), unset_fake_temporarily():
        whole = config.model.build()
        # A transform may swap in modules that initialise their own way (torchao's float8 linears
        # draw as torch's Linear does): the seeded values come from the model as configured.
        initial = config.model.build() if transforms else whole
        apply_model_transforms(transforms, whole, backend.device)  # what it adds is on the meta device too
    model = backend.parallelize(whole)  # ``whole`` itself, or this process's pipeline stages of it
    if fill:
        torch.manual_seed(config.trainer.seed)
        # The seeded draws are the whole model's, so every pipeline stage gets its own.
        values: Iterable[tuple[str, torch.Tensor]] = (
            initial_parameter_values(initial) if pretrained is None else pretrained.release_parameters()
        )
        materialize(backend, model, with_fresh_adapters(values, whole), whole_model=model is whole)
    # e.g. an int8 frozen base, before any optimizer
    apply_model_transforms(transforms, model, backend.device, loaded=True)
    return model


def build_run_backend(config: ExperimentConfig) -> Backend:
    """The configured backend; under bf16 it gathers parameters in bf16 and reduces in ``trainer.reduce_precision``.

    Pipeline stages balance the layers' FLOPs at the data's ``seq_len`` (``layer_flops_per_token``).
    """
    bf16 = config.trainer.precision is Precision.bf16
    staged = config.mesh.pipe != 1
    return build_backend(
        config.backend,
        config.mesh,
        config.sharding,
        config.trainer.device,
        config.pipeline,
        gather_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=config.trainer.reduce_precision.dtype if bf16 else None,
        execution=config.execution,
        layer_costs=layer_flops_per_token(config.model, config.data.seq_len) if staged else None,
    )


def rows_per_replica(trainer: TrainerConfig, replicas: int) -> int:
    """This data-parallel replica's rows of a step, which ``grad_accum_steps`` micro-batches split evenly."""
    if trainer.batch_size % (replicas * trainer.grad_accum_steps):
        raise ConfigError(
            "trainer.batch_size",
            trainer.batch_size,
            f"a multiple of {replicas} data-parallel replicas x {trainer.grad_accum_steps} accumulation steps",
        )
    return trainer.batch_size // replicas


def _pretrained_start(config: ExperimentConfig, run_dir: Path) -> tuple[Optional[Pretrained], Optional[Path]]:
    """The imported weights a run starts from (``init_from``) and their tokenizer's path; (None, None) without.

    Resuming, the weights come from the checkpoint (unless it holds only adapters): only the
    tokenizer's path is returned then.
    """
    if not config.init_from:
        return None, None
    if list_checkpoints(run_dir / CHECKPOINTS_DIR) and config.model.adapter is None:
        return None, pretrained_tokenizer_path(config.init_from, run_dir)
    pretrained = load_pretrained(config.init_from, run_dir)
    check_same_architecture(config.model, pretrained.config, config.init_from)
    return pretrained, pretrained.tokenizer_path


def _with_tokenizer(config: ExperimentConfig, tokenizer_path: Optional[Path]) -> ExperimentConfig:
    """A copy of ``config`` whose data reads ``tokenizer_path``; ``config`` itself when None."""
    if tokenizer_path is None:
        return config
    tokenizer = dataclasses.replace(config.data.tokenizer, path=str(tokenizer_path))
    resolved = copy.copy(config)  # not ``dataclasses.replace``: that would apply deprecated settings again
    resolved.data = dataclasses.replace(config.data, tokenizer=tokenizer)
    return resolved


def _check_vocabulary(model_vocab_size: int, tokenizer_vocab_size: int) -> None:
    if tokenizer_vocab_size > model_vocab_size:
        raise ConfigError(
            "model.vocab_size",
            model_vocab_size,
            f"at least the tokenizer's {tokenizer_vocab_size}",
            reason="token ids would index past the embedding table",
        )


class Trainer:
    """Data, model, optimizer and checkpoints of one run directory, and the loop (``fit``) over them."""

    def __init__(self, config: ExperimentConfig, backend: Optional[Backend] = None):
        self.run_dir = Path(config.run_dir)
        self.goodput = GoodputRecorder(self.run_dir, enabled=False)  # starts the clock; enabled in fit()
        self.backend = backend or build_run_backend(config)
        self.device = self.backend.device
        self.local_batch_size = rows_per_replica(config.trainer, self.backend.data_parallel_size)
        random.seed(config.trainer.seed)
        self.pretrained, tokenizer_path = _pretrained_start(config, self.run_dir)
        #: The run's config: the caller's, with the imported tokenizer's path when ``init_from`` brings one.
        self.config = config = _with_tokenizer(config, tokenizer_path)
        self.data = self._build_data_once()
        _check_vocabulary(config.model.vocab_size, self.data.tokenizer.vocab_size)
        self.model = build_parallel_model(config, self.backend, self.pretrained)
        self.pretrained = None  # free the imported copy
        self.compiling = compile_choice(config, self.device)
        #: What stays eager in the compiled layers, one line a reason (said with the compile line).
        self.eager_parts = compile_layers(self.model) if self.compiling.enabled else []
        self.compiles = CompileWatch()
        self.optimizer = build_optimizer(self.model, config.optim)
        self.backend.prepare_optimizer(self.optimizer)
        micro_batch_size = self.local_batch_size // config.trainer.grad_accum_steps
        self.work = TrainStep(
            config, self.backend, self.model, config.loss.build(self.compiling.head), self.optimizer, micro_batch_size
        )
        trainer = config.trainer
        self.checkpointer = Checkpointer(
            self.run_dir / CHECKPOINTS_DIR,
            trainer.keep_checkpoints,
            trainer.async_checkpoint,
            collective=self.backend,
            keep_every=trainer.keep_every,
        )
        self.backend.runner.prepare(self.local_batch_size)
        self.train_batches = self.data.train_batches(
            trainer.batch_size, self.backend.data_parallel_rank, self.backend.data_parallel_size
        )
        self.step = 0
        self.tokens_per_step = trainer.batch_size * config.data.seq_len
        self.flops_per_token = self._flops_per_token()
        self.numerics = NonFiniteGuard(trainer.nonfinite, trainer.max_nonfinite_skips)
        #: Summed peak FLOP/s of the step's devices, found by the main process in fit(); None: no MFU.
        self.peak_flops: Optional[float] = None
        self._said_no_held_out_data = False
        self.config_text = config_to_yaml(config)
        model_text = config_to_yaml(config.model)
        self.model_digest = config_digest(model_text)
        #: The same model's digest as recorded before its config classes' modules were renamed.
        self._former_model_digest = config_digest(with_former_module_names(model_text))
        self.base_digest = base_digest(config)

    # ----------------------------------------------------------------------------------- setup

    def _build_data_once(self) -> DataModule:
        """The main process tokenizes and caches the corpus; the others then read its cache."""
        if self.backend.is_main_process:
            data = build_data(self.config.data)
            self.backend.barrier()
            return data
        self.backend.barrier()
        return build_data(self.config.data)

    def _flops_per_token(self) -> float:
        """The whole model's, counted again on the meta device when this process holds pipeline stages."""
        whole = self.model if self.backend.runner.holds_whole_model else None
        return model_flops_per_token(self.config.model, self.config.data.seq_len, whole)

    def _resolve_peak_flops(self) -> Optional[float]:
        dtype = torch.bfloat16 if self.config.trainer.precision is Precision.bf16 else torch.float32
        backend = self.backend
        return resolve_peak_flops(
            self.config.trainer.peak_flops, backend.device_name, dtype, backend.num_devices, backend.devices_per_process
        )

    def _prepare_run_dir(self) -> None:
        if not self.backend.is_main_process:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / CONFIG_FILE).write_text(self.config_text)
        # With the model's tokenizer settings beside it (BOS, end of turn, chat template) for generate and export.
        self.data.tokenizer.save(self.run_dir / TOKENIZER_FILE)

    # ---------------------------------------------------------------------------------- resume

    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            # Each rank knows only its own part of a streamed corpus's position: the checkpoint holds all.
            "data": self.train_batches.combine(self.backend.all_gather_object(self.train_batches.state_dict())),
            "rng": capture_rng_state(),
            "model_config_digest": self.model_digest,
            "config_digest": config_digest(self.config_text),
            BASE_DIGEST_KEY: self.base_digest,
        }

    def resume(self, path: Path) -> None:
        state = read_trainer_state(path)
        if state["model_config_digest"] not in (self.model_digest, self._former_model_digest):
            raise ConfigError(
                "model",
                "(changed)",
                f"the model config the checkpoint {path} was trained with",
                reason="the run directory holds checkpoints of a different model; use a new run_dir",
            )
        check_base(state, self.base_digest, path)
        self.checkpointer.load(path, self.model, self.optimizer, whole_model=self.backend.runner.holds_whole_model)
        self.step = state["step"]
        self.train_batches.load_state_dict(state["data"])
        restore_rng_state(state["rng"])

    def save_checkpoint(self) -> Optional[Path]:
        """Save (or start saving) a checkpoint of this step; None if it failed under the ``warn`` policy."""
        started = time.perf_counter()
        try:
            return self.checkpointer.save(self.step, self.model, self.optimizer, self.trainer_state())
        except CheckpointError as error:
            self._save_failed(error)
            return None
        finally:
            self.goodput.add("checkpoint", time.perf_counter() - started)

    def _settle_saves(self, block: bool) -> None:
        """Apply ``on_save_error`` to a failed background save (``block``: wait for the one in flight)."""
        try:
            self.checkpointer.wait() if block else self.checkpointer.poll()
        except CheckpointError as error:
            self._save_failed(error)

    def _save_failed(self, error: CheckpointError) -> None:
        if self.config.trainer.on_save_error is SaveErrorPolicy.stop:
            raise CheckpointError(f"step {self.step}: {error}; stopping (trainer.on_save_error=stop)") from error
        warnings.warn(
            f"step {self.step}: {error}; training goes on without it (trainer.on_save_error=warn)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None

    # ------------------------------------------------------------------------------ the step

    def _replica_rows(self, batch: Batch) -> Batch:
        """This replica's rows of a global batch (a final validation batch may be short)."""
        start = self.backend.data_parallel_rank * self.local_batch_size
        return {k: v[start : start + self.local_batch_size] for k, v in batch.items()}

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step over ``batch`` (this replica's rows of the global batch), with gradient
        accumulation (``TrainStep``), and the reads that decide whether its update applies.

        Where the optimizer can drop an update on the device (``TrainStep.skips_on_device``), the
        step is decided there and its loss and norm are read once, after the update is queued: the
        host never waits inside the step. Otherwise (torch_xla) they are read before the update.
        """
        loss_sum, grad_norm = self.work.gradients(batch)
        lr = learning_rate(self.config.optim.schedule, self.config.optim.lr, self.step, self.config.trainer.max_steps)
        if self.work.skips_on_device:
            self.work.update(lr, skip=~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm)))
            loss_value, norm_value = torch.stack([loss_sum.float(), grad_norm.float()]).tolist()
            # the same test as on the device; with nonfinite=stop it raises with the update already dropped
            apply = self.numerics.check(self.step + 1, loss_value, norm_value)
        else:
            self.backend.run_traced()  # forward, backward and clipping as one program, before the reads below
            loss_value = float(loss_sum)
            norm_value = float(grad_norm)  # the global norm: every process takes the same decision below
            apply = self.numerics.check(self.step + 1, loss_value, norm_value)
            self.work.update(lr if apply else None)
            self.backend.run_traced()  # the update
        self.step += 1
        metrics = {"train/loss": loss_value, "train/grad_norm": norm_value, "train/lr": lr}
        if not apply:
            metrics["train/skipped_update"] = 1.0
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Token-weighted cross-entropy over the held-out split; empty when there is no held-out data."""
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # (loss sum, tokens)
        self.backend.run_traced()  # the sums as data, not a constant: the first batch's program is every batch's
        for batch in self.data.val_batches(self.config.trainer.batch_size, self.config.trainer.eval_batches):
            for mb in self.work.micro_batches(self._replica_rows(batch)):
                micro_batch_sums = self.backend.runner.evaluate(mb, self.work)
                if micro_batch_sums is not None:  # None: a short last batch a pipeline cannot split
                    sums += micro_batch_sums
                self.backend.run_traced()  # one batch's program, the same for every batch
        self.model.train()
        total, tokens = self.backend.all_reduce_sum(sums).tolist()
        if tokens == 0:
            return {}  # a loss over no tokens is not a score: report nothing rather than 0
        mean = total / tokens
        return {"eval/loss": mean, "eval/perplexity": math.exp(min(mean, 50.0))}

    # ------------------------------------------------------------------------------ the loop

    def fit(self, until_step: Optional[int] = None, preemption: Optional[PreemptionWatch] = None) -> TrainResult:
        """Train to ``trainer.max_steps`` (or stop early at ``until_step``, e.g. before a preemption).

        Resumes from the newest checkpoint in the run directory. Stopping early still checkpoints,
        so a later ``fit`` continues exactly where this one stopped. ``preemption``: a watch the
        caller entered before start-up (the command line does), so that a signal then counts too.
        """
        with preemption or PreemptionWatch() as watch:
            return self._fit(until_step, watch)

    def _fit(self, until_step: Optional[int], preemption: PreemptionWatch) -> TrainResult:
        trainer = self.config.trainer
        stop = trainer.max_steps if until_step is None else min(until_step, trainer.max_steps)
        last_checkpoint = self._resume_latest()
        self._prepare_run_dir()
        main = self.backend.is_main_process
        self.goodput.enabled = main
        initial_eval = final_eval = None
        metrics_logger = MetricsLogger(self.run_dir, enable_tensorboard=trainer.tensorboard) if main else None
        watchdog = Watchdog(trainer.watchdog_seconds, trainer.watchdog_action, self.run_dir, self.backend.rank)
        if main and self.compiling.enabled:
            print(f"compile: {self.compiling.reason}; each decoder layer compiles at its first use")
            for line in self.eager_parts:
                print(f"compile: {line}")
        with (
            self.checkpointer.saves_finish_on_error(),
            watchdog,
            self.compiles,
            metrics_logger or contextlib.nullcontext() as metrics,
        ):
            if self.step == 0:
                initial_eval = self._evaluate_and_log(metrics, print)
            if main:  # measured (on a CPU) before the clock for steps starts: part of start-up
                self.peak_flops = _best_effort("finding the devices' peak FLOP/s", self._resolve_peak_flops)
            self.goodput.start_training()
            progress = self._progress_bar(stop)
            window = _MetricsWindow()
            self.model.train()
            preempted_by = preemption.agreed(self.backend)  # during start-up: stop with nothing new to save
            while preempted_by is None and self.step < stop:
                fetched = time.perf_counter()
                set_aside = self._set_aside_seconds()
                compiled_before = (self.compiles.graphs, self.compiles.seconds)
                result, seconds = self._timed_train_step(next(self.train_batches), metrics)
                compile_seconds = self._note_compiles(compiled_before, progress.write)
                watchdog.step_done()
                self._settle_saves(block=False)  # a background save that failed stops the run now
                self._record_step(result, seconds, window, metrics, stop, progress)
                progress.update(1)
                if self.step % trainer.eval_every == 0 or self.step == trainer.max_steps:
                    final_eval = self._evaluate_and_log(metrics, progress.write)
                saved_now = self.step % trainer.checkpoint_every == 0 or self.step == stop
                if saved_now:
                    last_checkpoint = self.save_checkpoint() or last_checkpoint
                # The step's wall time, logging included, less its evaluation and checkpoint.
                set_aside = self._set_aside_seconds() - set_aside
                self.goodput.step_done(self.step, time.perf_counter() - fetched - set_aside, compile_seconds)
                if (preempted_by := preemption.agreed(self.backend)) and not saved_now:
                    last_checkpoint = self.save_checkpoint() or last_checkpoint
            progress.close()
        if preempted_by and self.step >= trainer.max_steps:
            if main:
                print(f"{preempted_by} arrived as the last step ended: the run finished")
            preempted_by = None
        if final_eval is None and preempted_by is None:  # resumed at (or past) the last step: report it
            final_eval = self.evaluate().get("eval/loss")
        self._wrap_up(plot=preempted_by is None)
        return TrainResult(self.run_dir, self.step, initial_eval, final_eval, last_checkpoint, preempted_by)

    def _resume_latest(self) -> Optional[Path]:
        """Resume from the newest valid checkpoint of the run directory, if there is one; return it."""
        latest = self.checkpointer.latest_valid()
        if latest is not None:
            self.resume(latest)  # first: a refused resume must leave the run directory untouched
            if self.backend.is_main_process:
                print(f"resumed from {latest} at step {self.step}")
        return latest

    def _progress_bar(self, stop: int) -> tqdm:
        show = self.config.trainer.progress_bar and self.backend.is_main_process
        return tqdm(total=stop, initial=self.step, disable=not show, desc="train", unit="step", dynamic_ncols=True)

    def _note_compiles(self, before: tuple[int, float], say: Callable[[str], Any]) -> float:
        """The seconds this step spent compiling; a compile after the second step is said, once a step."""
        graphs, seconds = self.compiles.graphs - before[0], self.compiles.seconds - before[1]
        if graphs and self.step > 2 and self.backend.is_main_process:
            say(
                f"step {self.step}: torch.compile compiled {graphs} more graph(s) in {seconds:.1f} s "
                f"({self.compiles.graphs} in all): a shape or guard changed; TORCH_LOGS=recompiles says which"
            )
        return seconds

    def _set_aside_seconds(self) -> float:
        """Seconds spent on evaluation and checkpoints so far: not part of any step's time."""
        return self.goodput.seconds["eval"] + self.goodput.seconds["checkpoint"]

    def _timed_train_step(self, batch: Batch, metrics: Optional[MetricsLogger]) -> tuple[dict[str, float], float]:
        """``train_step`` and its seconds; a non-finite loss ends the run, after saving the last good state."""
        started = time.perf_counter()
        try:
            result = self.train_step(batch)
        except NonFiniteError as error:
            self._log_event(metrics, {"nonfinite/stopped": 1.0})
            self.save_checkpoint()  # the last good state: the bad update was not applied
            self.checkpointer.wait()
            raise NonFiniteError(f"{error}; saved the last good state at step {self.step}") from error
        return result, time.perf_counter() - started

    def _record_step(
        self,
        result: dict[str, float],
        seconds: float,
        window: _MetricsWindow,
        metrics: Optional[MetricsLogger],
        stop: int,
        progress: tqdm,
    ) -> None:
        """Add a step to the metrics window (a skipped update is logged as an event instead); log it when due."""
        window.seconds += seconds
        if result.get("train/skipped_update"):
            self._log_event(
                metrics,
                {
                    "nonfinite/skipped_update": 1.0,
                    "nonfinite/loss": result["train/loss"],
                    "nonfinite/grad_norm": result["train/grad_norm"],
                },
            )
        else:
            window.results.append(result)
        log_every = self.config.trainer.log_every
        # Only the main process has a logger (``metrics`` is None on the others).
        if metrics is not None and window.results and (self.step % log_every == 0 or self.step == stop):
            logged = _best_effort("computing train metrics", self._window_metrics, window.results, window.seconds)
            if logged:
                logged.update(_best_effort("recording goodput", self.goodput.write) or {})
                _best_effort("logging metrics", metrics.log, self.step, logged)
                progress.set_postfix(loss=f"{logged['train/loss']:.3f}", tok_s=f"{logged['train/tokens_per_s']:.0f}")
        if self.step % log_every == 0:
            window.results, window.seconds = [], 0.0

    def _wrap_up(self, plot: bool) -> None:
        """Settle the last background save, record goodput, and (``plot``) draw the loss curves."""
        waiting = time.perf_counter()
        self._settle_saves(block=True)
        self.goodput.add("checkpoint", time.perf_counter() - waiting)
        _best_effort("recording goodput", self.goodput.write)
        if plot and self.config.trainer.plot and self.backend.is_main_process:
            from axtorch.train.curves import plot_runs  # matplotlib: 0.35 s of start-up, only for the plot

            _best_effort(f"plotting {LOSS_PLOT_FILE}", plot_runs, [self.run_dir], self.run_dir / LOSS_PLOT_FILE)

    def _log_event(self, metrics: Optional[MetricsLogger], event: dict[str, float]) -> None:
        """Record an event of this step in metrics.jsonl (main process only)."""
        if metrics is not None:
            _best_effort("logging metrics", metrics.log, self.step, event)

    def _evaluate_and_log(self, metrics: Optional[MetricsLogger], say: Callable[[str], Any]) -> Optional[float]:
        """Evaluate, log and announce the held-out loss; None (said once) when there is no held-out data."""
        started = time.perf_counter()
        evaluated = self.evaluate()
        self.goodput.add("eval", time.perf_counter() - started)
        if metrics is None:
            return evaluated.get("eval/loss")
        if not evaluated:
            if not self._said_no_held_out_data:
                say(f"no held-out data (data.val_fraction={self.config.data.val_fraction}): eval/loss is not reported")
                self._said_no_held_out_data = True
            return None
        _best_effort("logging metrics", metrics.log, self.step, evaluated)
        if self.step > 0:
            say(f"step {self.step}: eval loss {evaluated['eval/loss']:.4f} (ppl {evaluated['eval/perplexity']:.1f})")
        return evaluated["eval/loss"]

    def _window_metrics(self, window: list[dict[str, float]], seconds: float) -> dict[str, float]:
        tokens_per_s = self.tokens_per_step * len(window) / max(seconds, 1e-9)
        logged = {
            "train/loss": sum(m["train/loss"] for m in window) / len(window),
            "train/grad_norm": sum(m["train/grad_norm"] for m in window) / len(window),
            "train/lr": window[-1]["train/lr"],
            "train/tokens_per_s": tokens_per_s,
            "train/memory_gb": _peak_memory_gb(self.device),
        }
        if self.peak_flops is not None:
            logged["train/mfu"] = mfu(tokens_per_s, self.flops_per_token, self.peak_flops)
        return logged


@dataclass
class _MetricsWindow:
    """The steps since train metrics were last logged: their results (skipped updates left out) and seconds."""

    results: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


def _best_effort(what: str, function: Callable[..., T], *args: Any) -> Optional[T]:
    """Run a metrics, logging or plotting step; a failure there warns and never ends training."""
    try:
        return function(*args)
    except Exception as error:
        warnings.warn(f"{what} failed, training goes on: {type(error).__name__}: {error}", RuntimeWarning, stacklevel=2)
        return None


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux
