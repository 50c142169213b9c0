"""Print the loss-parity table of the backend tests: every backend and mesh, same seed and batch.

    cd tests/parallel && ../../.venv/bin/python parity_table.py [WORK_DIR]

Runs the runs that ``test_native_backend.py`` and ``test_xla_backend.py`` assert on (a few
minutes on 2 cores) and prints their per-step training losses as a Markdown table.
"""

import sys
import tempfile
from pathlib import Path

from debug_runs import STEPS, debug_overrides, train_losses, train_on_one_device
from test_native_backend import train_on_ranks
from test_xla_backend import _xla


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="axtorch-parity-"))
    cache = root / "cache"
    train_on_one_device(root / "single", cache)
    xla_runs = {
        "xla, 1 device": (1, []),
        "xla, fsdp=4": (4, ["mesh.fsdp=4", "sharding=fsdp"]),
        "xla, fsdp=2 x model=2": (4, ["mesh.fsdp=2", "mesh.model=2", "sharding=fsdp_tp"]),
        "xla, fsdp=2 x seq=2": (4, ["mesh.fsdp=2", "mesh.seq=2", "sharding=fsdp"]),
        "xla, fsdp=4, layer_runner=scan + remat=full": (
            4,
            ["mesh.fsdp=4", "sharding=fsdp", "execution.layer_runner=scan", "model/remat=full"],
        ),
    }
    native_runs = {
        "native torchrun 2 procs, fsdp=2": (2, ["mesh.fsdp=2", "sharding=fsdp"]),
        "native torchrun 2 procs, model=2": (2, ["mesh.model=2", "sharding=fsdp_tp"]),
        "native torchrun 4 procs, fsdp=2 x model=2": (4, ["mesh.fsdp=2", "mesh.model=2", "sharding=fsdp_tp"]),
        "native torchrun 2 procs, seq=2": (2, ["mesh.seq=2"]),
        "native torchrun 4 procs, fsdp=2 x seq=2": (4, ["mesh.fsdp=2", "mesh.seq=2"]),
        "native torchrun 4 procs, seq=2 x model=2": (4, ["mesh.seq=2", "mesh.model=2", "sharding=fsdp_tp"]),
        "native torchrun 4 procs, HSDP data=2 x fsdp=2": (4, ["mesh.data=2", "mesh.fsdp=2"]),
        "native torchrun 2 procs, pipe=2 (1F1B, 4 micro-batches)": (2, ["mesh.pipe=2"]),
        "native torchrun 2 procs, pipe=2 (GPipe)": (2, ["mesh.pipe=2", "pipeline.schedule=gpipe"]),
        "native torchrun 4 procs, pipe=2 x fsdp=2": (4, ["mesh.pipe=2", "mesh.fsdp=2", "sharding=fsdp"]),
        "native torchrun 4 procs, pipe=2 x model=2": (4, ["mesh.pipe=2", "mesh.model=2", "sharding=fsdp_tp"]),
        # A dense model: the expert axis is data-parallel (the MoE rows are in test_native_moe.py).
        "native torchrun 2 procs, expert=2": (2, ["mesh.expert=2", "sharding=fsdp_ep"]),
    }
    run_dirs = {"single": root / "single"}
    for index, (label, (devices, overrides)) in enumerate(xla_runs.items()):
        run_dirs[label] = root / f"xla{index}"
        _xla(devices, root / f"xla{index}.json", STEPS, debug_overrides(run_dirs[label], cache, *overrides))
    for index, (label, (processes, overrides)) in enumerate(native_runs.items()):
        run_dirs[label] = root / f"native{index}"
        train_on_ranks(
            processes,
            root / f"native{index}",
            STEPS,
            debug_overrides(run_dirs[label], cache, "backend=native", *overrides),
        )
    print("| backend / mesh | " + " | ".join(f"step {i + 1}" for i in range(STEPS)) + " |")
    print("|---|" + "---|" * STEPS)
    for label, run_dir in run_dirs.items():
        print(f"| {label} | " + " | ".join(f"{loss:.6f}" for loss in train_losses(run_dir)) + " |")


if __name__ == "__main__":
    main()
