"""Run under torchrun (or forked ranks) by the dry run's reality check: a real trainer's step on real
data, measured by torch's profiler, not by anything the dry run uses.

    torchrun --nproc-per-node N tests/parallel/real_step_worker.py OUT RUN_DIR OVERRIDE...

The step is ``Trainer.train_step``'s second (the first creates the optimizer state), on the
data's real tokens, with the router's real choices. Each rank measures
- the CPU allocator's own count of bytes allocated and not yet freed during the step, at its
  highest (the profiler's ``[memory]`` events, ``Total Allocated``, counted from the step's start);
- the bytes the step starts with that are its parameters and optimizer state, from the tensors;
- the collectives the process group ran (the profiler's ``record_param_comms`` events: the
  collective's name, its group's size and the bytes it moved);
- the FLOPs of its matrix products and CPU attention kernels, counted here from the shapes the
  profiler recorded (``2 m k n`` a product).

Rank 0 writes OUT (JSON): every rank's measurement, in rank order.
"""

import json
import math
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.parallel.shutdown import exit_process
from axtorch.train.trainer import Trainer

ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, torch.distributed.tensor.DTensor) else tensor
    return local.numel() * local.element_size()


def _matmul_flops(events: list[dict]) -> float:
    """``2 m k n`` (times the batch) of every matrix product that ran on plain tensors, from the
    shapes the profiler recorded. A DTensor's product is an event around its local one (at the
    global shapes): an event that holds another product of its thread within its time is left out."""
    products = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("name") in _OPERANDS), key=lambda e: (e["tid"], e["ts"])
    )
    total = 0
    for index, event in enumerate(products):
        end = event["ts"] + event["dur"]
        inner = next((e for e in products[index + 1 :] if e["tid"] == event["tid"] and e["ts"] < end), None)
        if inner is not None and inner["ts"] + inner["dur"] <= end:
            continue  # a DTensor's product around its local one
        first, second = (event["args"]["Input Dims"][i] for i in _OPERANDS[event["name"]])
        total += 2 * math.prod(first) * second[-1]
    return float(total)


#: A matrix product's operator -> the positions of its two factors among its inputs.
_OPERANDS = {
    "aten::mm": (0, 1),
    "aten::bmm": (0, 1),
    "aten::addmm": (1, 2),
    "aten::addmm_": (1, 2),  # the fused loss accumulates the head's gradient with it
    "aten::baddbmm": (1, 2),
}


def _outermost_only(events: list[dict]) -> list[dict]:
    """Collectives not inside another on the same thread: a functional collective runs the process
    group's own operator inside it, and is one collective."""
    ordered = sorted(events, key=lambda e: (e["tid"], e["ts"]))
    kept: list[dict] = []
    for event in ordered:
        outer = kept[-1] if kept and kept[-1]["tid"] == event["tid"] else None
        if outer is None or event["ts"] >= outer["ts"] + outer["dur"]:
            kept.append(event)
    return kept


def _attention_flops(events: list[dict]) -> float:
    """Scores and weighted values forward; scores again, then the four gradients' matmuls backward."""
    flops = 0.0
    for event in events:
        if event.get("name") not in (ATTENTION, ATTENTION + "_backward"):
            continue
        dims = event["args"]["Input Dims"]
        query, key = (dims[0], dims[1]) if event["name"] == ATTENTION else (dims[1], dims[2])
        rows, heads, queries, width = query
        products = 2 if event["name"] == ATTENTION else 5
        flops += products * 2 * rows * heads * queries * key[2] * width
    return flops


#: The process group's operators as the dispatcher runs them (``c10d::allreduce_``...), by kind.
COLLECTIVES = {
    "c10d::allreduce_": "all-reduce",
    "c10d::_allgather_base_": "all-gather",
    "c10d::allgather_": "all-gather",
    "c10d::_reduce_scatter_base_": "reduce-scatter",
    "c10d::reduce_scatter_": "reduce-scatter",
    "c10d::alltoall_base_": "all-to-all",
    "c10d::broadcast_": "broadcast",
    "c10d::send": "send",
    "c10d::recv_": "recv",
    # DTensor's redistributions, through the functional collectives.
    "_c10d_functional::all_reduce": "all-reduce",
    "_c10d_functional::all_gather_into_tensor": "all-gather",
    "_c10d_functional::reduce_scatter_tensor": "reduce-scatter",
    "_c10d_functional::all_to_all_single": "all-to-all",
}
ELEMENT_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "double": 8}


def _largest_tensor_bytes(name: str, args: dict) -> int:
    """The largest tensor the operator was given or (a functional all-gather) returns: the gathered
    whole, the scattered whole. A tensor list's dtype is not recorded: it counts as float32."""
    if name == "_c10d_functional::all_gather_into_tensor":
        (shape, kind), group_size = (args["Input Dims"][0], args["Input type"][0]), int(args["Concrete Inputs"][1])
        return math.prod(shape) * ELEMENT_BYTES[kind] * group_size
    sizes = []
    for dims, kind in zip(args["Input Dims"], args["Input type"]):
        if kind == "TensorList":
            sizes += [math.prod(shape) * 4 for shape in dims]
        elif kind in ELEMENT_BYTES:
            sizes.append(math.prod(dims) * ELEMENT_BYTES[kind])
    return max(sizes, default=0)


def main() -> None:
    out, run_dir, *overrides = sys.argv[1:]
    config = load_experiment_config(
        [*overrides, f"run_dir={run_dir}/rank{dist.get_rank() if dist.is_initialized() else 0}"]
    )
    trainer = Trainer(config)
    trainer.train_step(next(trainer.train_batches))
    batch = next(trainer.train_batches)
    held = sum(_local_bytes(p) for p in trainer.model.parameters())
    state = sum(_local_bytes(v) for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        trainer.train_step(batch)
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    allocated = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    collectives: Counter = Counter()
    moved: Counter = Counter()
    issued = [e for e in events if e.get("ph") == "X" and e.get("name") in COLLECTIVES]
    for event in _outermost_only(issued):
        kind = COLLECTIVES[event["name"]]
        collectives[kind] += 1
        moved[kind] += _largest_tensor_bytes(event["name"], event["args"])
    measured = {
        "peak_above_start": max(allocated, default=0),
        "parameters": held,
        "optimizer state": state,
        "collectives": dict(collectives),
        "collective_bytes": dict(moved),
        "flops": _matmul_flops(events) + _attention_flops(events),
    }
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, measured)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(every_rank))
    exit_process(0, skip_finalization=True)


if __name__ == "__main__":
    main()
