"""Run in its own process under the xla venv by the XLA tests: train, then report shard shapes.

PJRT_DEVICE=CPU CPU_NUM_DEVICES=N python tests/parallel/xla_worker.py OUT_JSON UNTIL_STEP OVERRIDE...

Under torchrun with ``AXTORCH_XLA_SIMULATED_HOSTS=1`` each process acts as one host and writes
``OUT_JSON`` with ``.host<i>`` before its suffix.
"""

import json
import sys

import torch
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as metrics
import torch_xla.distributed.spmd as xs
import torch_xla.experimental.scan as xla_scan

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.parallel.shutdown import exit_process
from axtorch.parallel.xla import local_shard_shapes
from axtorch.train.trainer import Trainer


def _count(counter: str) -> int:
    xm.wait_device_ops()  # executions are counted as they run, asynchronously
    return metrics.counter_value(counter) or 0


def _count_scan_traces() -> list[int]:
    """A counter of the scan's AOTAutograd traces of a layer group (one per ``aot_function`` call)."""
    traces = [0]
    aot_function = xla_scan.aot_function

    def counted(*args, **kwargs):
        traces[0] += 1
        return aot_function(*args, **kwargs)

    xla_scan.aot_function = counted
    return traces


def _own_device_rows(backend, tensor: torch.Tensor) -> dict[str, list]:
    """The rows each of this host's devices holds, by device ("CPU:2": [[...], ...]). A simulated
    host's runtime holds every device; its own are its block of them."""
    own = backend.hosts.device_block(backend.num_devices) if backend.hosts.simulated else None
    return {
        shard.shard_device: shard.data.tolist()
        for shard in xs.wrap_if_sharded(tensor).local_shards
        if own is None or int(shard.shard_device.rpartition(":")[2]) in own
    }


def main() -> None:
    out, until_step, *overrides = sys.argv[1:]
    traces = _count_scan_traces()
    trainer = Trainer(load_experiment_config(overrides))
    programs: list[dict[str, int]] = []  # per training step: XLA programs compiled and run
    fed_rows: list[list[list[int]]] = []  # the first step's input rows, as this host's loader gave them
    train_step = trainer.train_step

    def counted_step(batch):
        if not fed_rows:
            fed_rows.append(batch["input_ids"].tolist())
        before = _count("UncachedCompile"), _count("ExecuteReplicated"), traces[0]
        out = train_step(batch)
        programs.append(
            {
                "compiled": _count("UncachedCompile") - before[0],
                "run": _count("ExecuteReplicated") - before[1],
                "scan_traces": traces[0] - before[2],
            }
        )
        return out

    evaluations: list[list[int]] = []  # per evaluation: XLA programs compiled by each program it ran
    evaluate, run_traced = trainer.evaluate, trainer.backend.run_traced

    def counted_evaluate():
        compiled: list[int] = []

        def counted_run():
            before = _count("UncachedCompile")
            run_traced()
            compiled.append(_count("UncachedCompile") - before)

        trainer.backend.run_traced = counted_run
        try:
            return evaluate()
        finally:
            trainer.backend.run_traced = run_traced
            evaluations.append(compiled)

    trainer.train_step = counted_step
    trainer.evaluate = counted_evaluate
    result = trainer.fit(until_step=int(until_step))
    config = trainer.config
    backend = trainer.backend
    rows = torch.zeros(config.trainer.batch_size // backend.data_parallel_size, config.data.seq_len, dtype=torch.long)
    report = {
        "step": result.step,
        "host": [backend.rank, backend.world_size],
        "devices_per_process": backend.devices_per_process,
        "fed_rows": fed_rows[0] if fed_rows else None,
        "programs": programs,
        "evaluations": evaluations,
        "parameters": {},
        "optimizer": {},
        "batch_shards": local_shard_shapes(backend.to_device({"input_ids": rows})["input_ids"]),
        # Where this host's first rows land: on its own devices, or (a wrong gather) another host's.
        "device_rows": _own_device_rows(
            backend, backend.to_device({"input_ids": torch.tensor(fed_rows[0])})["input_ids"]
        )
        if fed_rows
        else None,
    }
    for group in trainer.optimizer.param_groups:
        for name, param in zip(group["names"], group["params"]):
            report["parameters"][name] = {"shape": list(param.shape), "shards": local_shard_shapes(param)}
            state = trainer.optimizer.state[param]
            report["optimizer"][name] = {key: local_shard_shapes(state[key]) for key in ("exp_avg", "exp_avg_sq")}
    if backend.world_size > 1:
        out = out.removesuffix(".json") + f".host{backend.rank}.json"
    with open(out, "w") as handle:
        json.dump(report, handle)
    backend.close()
    exit_process(0, skip_finalization=backend.world_size > 1)


if __name__ == "__main__":
    main()
