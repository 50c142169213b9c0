"""How a step is split into pipeline stages and micro-batches (``pipeline.*``), checked without torch.distributed."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

from axtorch.config.errors import ConfigError

#: The schedules of ``torch.distributed.pipelining`` that ``pipeline.schedule`` names.
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass
class PipelineConfig:
    """How a step runs through ``mesh.pipe`` stages (ignored when ``mesh.pipe`` is 1)."""

    #: ``gpipe`` (all forwards, then all backwards), ``1f1b`` (one forward, one backward: at most
    #: ``pipe`` micro-batches of activations held) or ``interleaved_1f1b`` (several stages per
    #: process, which shrinks the pipeline bubble).
    schedule: str = "1f1b"
    #: Micro-batches per step: each data-parallel replica's rows are cut into this many. Null:
    #: the most, up to twice the stages, that divides the rows (at least the stage count).
    microbatches: Optional[int] = None
    #: Stages each process holds; ``interleaved_1f1b`` needs 2 or more, the others 1.
    stages_per_process: int = 1
    #: The first layer of each stage after the first (``stages - 1`` increasing indices); null
    #: splits the layers by their cost (``layer_ranges``): as evenly as they go in a uniform
    #: stack, the extra ones to the first stages.
    split_points: Optional[list[int]] = None

    def num_stages(self, pipe: int) -> int:
        return pipe * self.stages_per_process

    def resolved_microbatches(self, pipe: int, rows_per_replica: int) -> int:
        if self.microbatches is not None:
            return self.microbatches
        stages = self.num_stages(pipe)
        fitting = [m for m in range(stages, 2 * stages + 1) if rows_per_replica % m == 0]
        return fitting[-1] if fitting else 2 * stages

    def planned_microbatches(self, pipe: int) -> int:
        """The micro-batches a plan of ``axtorch-plan batch=`` rows per micro-batch assumes: the
        configured count, else twice the stages (what a step of that many micro-batches resolves to)."""
        if pipe == 1:
            return 1
        return self.resolved_microbatches(pipe, 2 * self.num_stages(pipe))

    def microbatches_in_flight(self, pipe: int, microbatches: int) -> float:
        """Micro-batches of activations the first process holds at once: all of them under GPipe,
        one per stage under 1F1B, a little more interleaved (Narayanan et al. 2021)."""
        if self.schedule == "gpipe":
            return microbatches
        one_f_one_b = min(microbatches, pipe)
        if self.schedule == "interleaved_1f1b":
            return one_f_one_b * (1 + (pipe - 1) / (pipe * self.stages_per_process))
        return one_f_one_b

    def bubble(self, pipe: int, microbatches: int) -> float:
        """The share of a step the pipeline idles: ``(pipe - 1) / (stages per process x micro-batches + pipe - 1)``."""
        return (pipe - 1) / (self.stages_per_process * microbatches + pipe - 1)

    def validate(self, pipe: int, num_layers: int, rows_per_replica: int, key: str = "pipeline") -> None:
        if self.schedule not in SCHEDULE_NAMES:
            raise ConfigError(f"{key}.schedule", self.schedule, f"one of {list(SCHEDULE_NAMES)}")
        interleaved = self.schedule == "interleaved_1f1b"
        if self.stages_per_process < 1 or (self.stages_per_process > 1) != interleaved:
            raise ConfigError(
                f"{key}.stages_per_process",
                self.stages_per_process,
                "2 or more with schedule=interleaved_1f1b, 1 with the others",
            )
        stages = self.num_stages(pipe)
        microbatches = self.resolved_microbatches(pipe, rows_per_replica)
        if microbatches < stages or rows_per_replica % microbatches:
            raise ConfigError(
                f"{key}.microbatches",
                microbatches,
                f"at least the {stages} stages, dividing the {rows_per_replica} rows of each data-parallel replica",
                reason="every stage needs a micro-batch in flight, and micro-batches are equal cuts of the rows",
            )
        check_split(num_layers, stages, self.split_points, f"{key}.split_points")


def check_split(num_layers: int, stages: int, split_points: Optional[list[int]], key: str) -> None:
    """Every stage gets at least one layer: ``num_layers`` suffices, and ``split_points`` (if given) fit."""
    if split_points is None:
        if num_layers < stages:
            raise ConfigError("model.decoder.num_layers", num_layers, f"at least the {stages} pipeline stages")
        return
    starts = [0, *split_points]
    if len(split_points) != stages - 1 or any(b <= a for a, b in zip(starts, [*starts[1:], num_layers])):
        raise ConfigError(
            key,
            list(split_points),
            f"{stages - 1} increasing layer indices between 1 and {num_layers - 1}",
            reason=f"{stages} stages of at least one layer each over {num_layers} layers",
        )


def layer_ranges(
    layer_costs: Sequence[int], stages: int, split_points: Optional[list[int]], key: str = "pipeline.split_points"
) -> list[range]:
    """The layers of each stage: at ``split_points``, or split by ``layer_costs`` (one per layer,
    e.g. ``axtorch.train.flops.layer_flops_per_token``) into ``balanced_starts``."""
    num_layers = len(layer_costs)
    check_split(num_layers, stages, split_points, key)
    starts = balanced_starts(layer_costs, stages) if split_points is None else [0, *split_points]
    return [range(start, end) for start, end in zip(starts, [*starts[1:], num_layers])]


def balanced_starts(layer_costs: Sequence[int], stages: int) -> list[int]:
    """The first layer of each of ``stages`` contiguous stages whose largest cost is the least it can be
    (``_balanced_starts``, computed once per costs and stage count)."""
    return list(_balanced_starts(tuple(layer_costs), stages))


@functools.lru_cache(maxsize=256)
def _balanced_starts(layer_costs: tuple[int, ...], stages: int) -> tuple[int, ...]:
    """The first layer of each of ``stages`` contiguous stages whose largest cost is the least it can be.

    A step waits for its slowest stage, so that largest cost is what a split decides. Among the
    splits that reach it, the most even (the least sum of squared stage costs) is taken, and
    among those the one whose earlier stages are longer: equal costs thus give exactly the even
    split by layer count, the extra layers to the first stages. Integer costs keep ties exact.
    Dynamic programming over suffixes, O(stages x layers^2): cached, as a plan search asks for the
    same split for every mesh with the same stage count (2145 times for llama3_405b on 2048 devices).
    """
    num_layers = len(layer_costs)
    prefix = list(itertools.accumulate(layer_costs, initial=0))

    def cost(start: int, end: int) -> int:
        return prefix[end] - prefix[start]

    def ends(start: int, remaining: int) -> range:
        """Where a stage from ``start`` may end, the longest first, leaving a layer to each of ``remaining`` stages."""
        return range(num_layers - remaining, start, -1)

    # largest[s][i]: the least largest stage cost of layers i.. in s stages.
    largest = [[0] * (num_layers + 1) for _ in range(stages + 1)]
    largest[1] = [cost(i, num_layers) for i in range(num_layers + 1)]
    for s in range(2, stages + 1):
        for i in range(num_layers - s + 1):
            largest[s][i] = min(max(cost(i, j), largest[s - 1][j]) for j in ends(i, s - 1))
    bound = largest[stages][0]
    # squares[s][i]: the least sum of squared stage costs of layers i.. in s stages of at most ``bound``.
    infinite = float("inf")
    squares: list[list[float]] = [[infinite] * (num_layers + 1) for _ in range(stages + 1)]
    squares[1] = [cost(i, num_layers) ** 2 if cost(i, num_layers) <= bound else infinite for i in range(num_layers + 1)]
    first_end: list[list[int]] = [[num_layers] * (num_layers + 1) for _ in range(stages + 1)]
    for s in range(2, stages + 1):
        for i in range(num_layers - s + 1):
            for j in ends(i, s - 1):  # the longest first: only a strictly smaller sum replaces it
                if cost(i, j) <= bound and cost(i, j) ** 2 + squares[s - 1][j] < squares[s][i]:
                    squares[s][i], first_end[s][i] = cost(i, j) ** 2 + squares[s - 1][j], j
    starts = [0]
    for s in range(stages, 1, -1):
        starts.append(first_end[s][starts[-1]])
    return tuple(starts)


def stages_of_process(pipe_rank: int, pipe: int, stages_per_process: int) -> list[int]:
    """The stages one process runs: ``rank``, ``rank + pipe``, ... (the interleaved schedules' loop)."""
    return [pipe_rank + loop * pipe for loop in range(stages_per_process)]


def stage_parameter_names(names: Iterable[str], stage_layers: list[range], stages: list[int]) -> list[str]:
    """The parameters a process of ``stages`` holds, as ``keep_stages`` keeps their modules: its
    stages' layers, the embeddings with the first stage, the final norm and the head with the last."""
    layers = {str(index) for stage in stages for index in stage_layers[stage]}
    first, last = 0 in stages, len(stage_layers) - 1 in stages

    def held(name: str) -> bool:
        if name.startswith("decoder.layers."):
            return name.split(".")[2] in layers
        if name.startswith(("embedding.", "position_embedding.")):
            return first
        return last

    return [name for name in names if held(name)]
