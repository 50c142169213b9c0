"""Train the same experiment eagerly, then with ``trainer.compile=true``; report both runs' losses and compiles.

    python tests/train/compiled_worker.py OUT.json STEPS OVERRIDE...    (or as every rank of a group)

Each run has its own run directory (``<run_dir>/eager``, ``<run_dir>/compiled``). ``graphs``: how many
graphs dynamo had captured after each step of the compiled run (its own ``unique_graphs`` counter,
not the compile callbacks the trainer counts with), from a cleared cache; ``compiled_regions_in_last_step``:
the compiled regions torch's profiler saw run in the last step.
"""

import json
import sys

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.parallel.shutdown import exit_process
from axtorch.train.trainer import Trainer

Run = tuple[list[float], list[int], int, Trainer]  # losses, graphs after each step, compiled regions, the trainer


def train(overrides: list[str], steps: int, run_dir: str, compiled: bool) -> Run:
    config = load_experiment_config([*overrides, f"run_dir={run_dir}", f"trainer.compile={str(compiled).lower()}"])
    trainer = Trainer(config)
    losses: list[float] = []
    graphs: list[int] = []
    regions = [0]
    step = trainer.train_step

    def counted(batch):
        if len(losses) == steps - 1:  # the last step: which of its regions ran compiled code
            with torch.profiler.profile() as profile:
                result = step(batch)
            regions[0] = sum(event.name.startswith("Torch-Compiled Region") for event in profile.events())
        else:
            result = step(batch)
        losses.append(result["train/loss"])
        graphs.append(counters["stats"]["unique_graphs"])
        return result

    trainer.train_step = counted
    trainer.fit(until_step=steps)
    return losses, graphs, regions[0], trainer


def main() -> None:
    out, steps, *overrides = sys.argv[1:]
    run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("run_dir="))
    rest = [o for o in overrides if not o.startswith("run_dir=")]
    eager, _, _, _ = train(rest, int(steps), f"{run_dir}/eager", compiled=False)
    torch._dynamo.reset()
    compiled, graphs, regions, trainer = train(rest, int(steps), f"{run_dir}/compiled", compiled=True)
    layers = list(trainer.model.decoder.layers)
    report = {
        "eager": eager,
        "compiled": compiled,
        "graphs": graphs,
        "compiled_regions_in_last_step": regions,
        "layers_compiled": sum(layer._compiled_call_impl is not None for layer in layers),
        "layers": len(layers),
    }
    if trainer.backend.rank == 0:
        with open(out, "w") as handle:
            json.dump(report, handle)
    trainer.backend.close()
    exit_process(0, skip_finalization=True)


if __name__ == "__main__":
    main()
