"""The planner's reports as ``axtorch-plan`` prints them: one plan, and a search's ranking with its mesh rule."""

from __future__ import annotations

from collections.abc import Sequence

from axtorch.parallel.chips import GIB, TERA
from axtorch.parallel.sharding import PartitionSpec
from axtorch.plan.cluster import Cluster
from axtorch.plan.placement import Plan
from axtorch.plan.search import Candidate
from axtorch.train.config import Precision


def format_plan(result: Plan) -> str:
    """The placement table, the per-device memory, the FLOPs and the precision of one plan."""
    mesh = " ".join(f"{axis}={size}" for axis, size in result.mesh_sizes.items())
    rows = [("parameter", "count", "global shape", "spec", "per-device shard")] + [
        (g.name, str(g.count), _shape(g.shape), _spec(g.spec), _shape(g.shard_shape)) for g in result.parameters
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    table.insert(1, "  ".join("-" * width for width in widths))
    memory = result.memory
    activations = (
        f"activations ({result.compute_precision.value}, batch {result.batch_size} x seq {result.seq_len}, "
        f"remat={result.remat})"
    )
    at_start = memory.at_backward_start_bytes >= memory.at_backward_end_bytes
    lines = [
        ("parameters (fp32)", memory.parameter_bytes),
        ("AdamW state (2x fp32)", memory.optimizer_bytes),
        (activations, memory.activation_bytes),
        ("weights held gathered (embedding, head, local experts; every weight under xla)", memory.gathered_bytes),
        ("output head's gradient (fused loss)", memory.head_bytes),
        ("gradients (fp32): at the backward's end, for the three above", memory.gradient_bytes),
        (f"peak (at the backward's {'start' if at_start else 'end'})", memory.total_bytes),
    ]
    label_width = max(len(label) for label, _ in lines)
    return "\n".join(
        [
            f"mesh: {mesh} ({result.num_devices} devices)",
            "",
            *table,
            "",
            f"total parameters: {result.total_parameters:,} ({result.total_parameters / 1e9:.2f}B)",
            f"active parameters per token: {result.active_parameters:,} ({result.active_parameters / 1e9:.2f}B)",
            "per-device memory:",
            *(f"  {label.ljust(label_width)}  {num_bytes / GIB:9.2f} GiB" for label, num_bytes in lines),
            f"training FLOPs per token (seq {result.seq_len}): {result.flops_per_token:.3e}",
            f"precision: {result.precision}",
            *(
                [f"sharding: {result.auto_sharding}, as sharding=auto chose it for this mesh"]
                if result.auto_sharding
                else []
            ),
            *_pipeline_lines(result),
        ]
    )


def format_candidates(candidates: Sequence[Candidate], cluster: Cluster, precision: Precision, top: int = 5) -> str:
    """The top candidates as a table, why each ranks where it does, and the best as a mesh rule."""
    peak = cluster.device.peak_flops(precision.dtype)
    header = (
        f"{cluster.hardware}: {cluster.devices} devices ({cluster.device.describe()}), "
        f"{cluster.memory_bytes / GIB:.0f} GiB each; trainer.precision={precision.value}: "
        f"{peak / TERA:.1f} TFLOP/s peak per device"
    )
    if not candidates:
        return f"{header}\nno mesh fits"
    rows = [
        "| rank | mesh | sharding | remat | memory/device | est. MFU | step time goes to |",
        "|---|---|---|---|---|---|---|",
    ]
    for rank, c in enumerate(candidates[:top], start=1):
        mesh = " ".join(f"{axis}={size}" for axis, size in c.mesh.items() if size > 1) or "(one device)"
        if c.mesh["pipe"] > 1:
            mesh += f" ({c.microbatches} micro-batches)"
        rows.append(
            f"| {rank} | {mesh} | {c.sharding} | {c.remat} | {c.memory_bytes / GIB:.1f} GiB | {c.mfu:.1%} | {c.why()} |"
        )
    return "\n".join(
        [f"{header}; {len(candidates)} meshes fit", "", *rows, "", *mesh_rule(candidates[0], cluster, precision)]
    )


def mesh_rule(best: Candidate, cluster: Cluster, precision: Precision) -> list[str]:
    """``best`` as a ``mesh_rules`` file (``MeshRulesConfig``) for this cluster's hardware id."""
    overrides = [*best.overrides(), f"trainer.precision={precision.value}"]
    return [
        "mesh rule for the best: save as <config dir>/mesh_rules/<name>.yaml, run with --config-dir <config dir> "
        "mesh_rules=<name>",
        "rules:",
        f"  - hardware: {cluster.hardware}",
        "    overrides: [" + ", ".join(overrides) + "]",
    ]


def _pipeline_lines(result: Plan) -> list[str]:
    if result.stage_layers is None or result.bubble is None:
        return []
    stages = " | ".join(f"{r.start}..{r.stop - 1}" if len(r) > 1 else str(r.start) for r in result.stage_layers)
    return [
        f"pipeline: {len(result.stage_layers)} stages, layers {stages}; memory above is the busiest process's",
        f"pipeline bubble: {result.bubble:.1%} of each step idle",
    ]


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _spec(spec: PartitionSpec) -> str:
    return "[" + ", ".join("None" if axes is None else "+".join(axes) for axes in spec) + "]"
