"""The host's time between two training steps: what a device idles for while the trainer reads each step's numbers.

    python benchmarks/host_gap.py [OVERRIDE ...]   (default: experiment=debug, logging every step)

The trainer reads a step's loss and gradient norm once, after its update is queued, then logs,
fetches the next batch and queues its forward. A device waits for the host over that gap at each
step; reading a step late would hide it behind the next step's work. This times the gap
(from ``Trainer.train_step``'s return to the next step's first call into ``TrainStep.gradients``)
over a real ``fit``, with the progress bar, metrics.jsonl and TensorBoard on.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.train.trainer import Trainer


def main(overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_experiment_config(
            [
                "experiment=debug",
                f"run_dir={run_dir}",
                *("trainer.max_steps=40", "trainer.eval_every=1000", "trainer.checkpoint_every=1000"),
                *("trainer.log_every=1", "trainer.progress_bar=true", "trainer.tensorboard=true"),
                *overrides,
            ]
        )
        trainer = Trainer(config)
        ended, gaps, steps = [], [], []
        gradients, train_step = trainer.work.gradients, trainer.train_step

        def timed_gradients(batch):
            if ended:
                gaps.append(time.perf_counter() - ended[-1])
            return gradients(batch)

        def timed_step(batch):
            started = time.perf_counter()
            result = train_step(batch)
            ended.append(time.perf_counter())
            steps.append(ended[-1] - started)
            return result

        trainer.work.gradients, trainer.train_step = timed_gradients, timed_step
        trainer.fit()
    gaps.sort()
    print(f"steps: {len(steps)}, median step {statistics.median(steps) * 1e3:.1f} ms")
    median, p90 = statistics.median(gaps), gaps[int(0.9 * len(gaps))]
    print(f"host gap between steps: median {median * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
