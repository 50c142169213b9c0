"""Run under torchrun by the native-backend tests: train, then report what each rank holds.

    torchrun --nproc-per-node N tests/parallel/native_worker.py OUT_PREFIX UNTIL_STEP OVERRIDE...

Writes ``OUT_PREFIX.rank<r>.json`` with the local and global element counts of the parameters and
of the optimizer state, and the trainer's final step.
"""

import json
import sys

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.parallel.shutdown import exit_process
from axtorch.parallel.tensor_shards import local_region
from axtorch.train.checkpoint import optimizer_tensors
from axtorch.train.trainer import Trainer


def _count(tensors) -> tuple[int, int]:
    local = total = 0
    for tensor in tensors:
        shape, _ = local_region(tensor)
        local += int(__import__("math").prod(shape))
        total += tensor.numel()
    return local, total


def main() -> None:
    out_prefix, until_step, *overrides = sys.argv[1:]
    trainer = Trainer(load_experiment_config(overrides))
    seen: dict[str, str] = {}

    def record_weight_dtype(module, args) -> None:  # as the layer computes: what FSDP gathered
        seen.setdefault("weight_dtype", str(module.attention.q_proj.weight.dtype))
        seen.setdefault("linear_class", type(module.attention.q_proj).__name__)

    next(iter(trainer.model.decoder.layers)).register_forward_pre_hook(record_weight_dtype)
    result = trainer.fit(until_step=int(until_step))
    params_local, params_total = _count(trainer.model.parameters())
    optim_local, optim_total = _count(t for t in optimizer_tensors(trainer.optimizer).values() if t.dim() > 0)
    report = {
        "step": result.step,
        "rank": trainer.backend.rank,
        "params_local": params_local,
        "params_total": params_total,
        "optim_local": optim_local,
        "optim_total": optim_total,
        "compute_weight_dtype": seen.get("weight_dtype"),
        "linear_class": seen.get("linear_class"),
        "flops_per_token": trainer.flops_per_token,
    }
    with open(f"{out_prefix}.rank{trainer.backend.rank}.json", "w") as handle:
        json.dump(report, handle)
    trainer.backend.close()
    exit_process(0, skip_finalization=True)


if __name__ == "__main__":
    main()
