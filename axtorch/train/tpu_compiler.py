"""The TPU compiler on any host: a traced SPMD program compiled for a named TPU slice, without a TPU.

libtpu (the ``tpu`` extra: torch_xla's own ``tpu`` and ``pallas`` pins) carries the compiler a TPU
VM runs. Through JAX it describes a slice (``jax.experimental.topologies``) with compile-only
devices, so the StableHLO that torch_xla traces compiles here exactly as it would before a
pod's first step: the partitioner inserts the collectives, the buffer assignment sizes each
chip's memory, the cost model counts FLOPs and bytes. Nothing runs.

The program is handed over as torch_xla lowers it, plus what the backend's own execution adds:
each argument's sharding (parameters, AdamW moments and the batch), each result's, and which
results reuse (alias) the buffers of the arguments they update.

This module imports JAX, never torch_xla: ``axtorch.parallel.xla`` traces, this compiles (for the
dry run, ``axtorch.train.xla_dry_run``, and the planner's compiled ranking).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from axtorch.config.errors import ConfigError
from axtorch.parallel.chips import TpuTopology

#: The opcodes of the collectives the partitioner inserts (an async pair counted at its start).
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}
_ELEMENT_BYTES |= {"s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\]")


def _load_jax() -> Any:
    """JAX with libtpu, or a ConfigError naming the extra that brings them."""
    # libtpu takes a lock file that guards a real TPU from two processes; a compile-only client
    # guards nothing, so two dry runs (or test workers) may compile at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        import libtpu  # noqa: F401  (the compiler itself: without it JAX knows no TPU)
        from jax.experimental import topologies
    except ImportError as error:
        raise ConfigError(
            "hardware",
            "a TPU topology",
            "an environment with the TPU compiler: pip install 'axtorch[tpu]' (torch_xla's tpu and pallas pins)",
            reason=f"{error.name or error} is not installed",
        ) from error
    return topologies


@dataclass
class Collective:
    kind: str
    count: int
    #: Bytes of the larger of each instance's operand and result, summed (a gather's whole result,
    #: a reduce-scatter's whole input), per chip.
    bytes: int


@dataclass
class CompiledStep:
    """What the TPU compiler says of one program, per chip."""

    topology: str
    devices: int
    device_kind: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temporary_bytes: int
    code_bytes: int
    flops: float
    bytes_accessed: float
    collectives: dict[str, Collective]
    compile_seconds: float
    #: The compiler's optimization effort it compiled at (``compile_program``).
    effort: float = 0.0
    #: Whether its 64-bit integer tensors were compiled as 32-bit ones (``compile_program``).
    int64_as_int32: bool = False
    #: Results the executable aliases to arguments, as (result, argument) indices.
    aliased: list[tuple[int, int]] = field(default_factory=list)

    @property
    def hbm_bytes(self) -> int:
        """What the program holds at once on a chip: arguments, the results that reuse no argument's
        buffer, the temporaries and the generated code."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temporary_bytes + self.code_bytes


class DoesNotFit(Exception):
    """The compiler could not fit the program in a chip's memory; its own message is kept."""

    def __init__(self, topology: str, message: str, compile_seconds: float):
        self.topology, self.message, self.compile_seconds = topology, message, compile_seconds
        super().__init__(message)


@contextlib.contextmanager
def _quiet_libtpu() -> Iterator[None]:
    """libtpu's start-up warnings about a TPU VM's environment this host lacks, which do not apply
    to a compile-only client, kept off the report (its C++ writes straight to file descriptor 2)
    while the topology is made."""
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def topology_devices(topology: TpuTopology) -> list[Any]:
    """The compile-only devices of ``topology``, in the order the compiler assigns partitions."""
    topologies = _load_jax()
    with _quiet_libtpu():
        description = topologies.get_topology_desc(topology_name=topology.name, platform="tpu")
    return list(description.devices)


def compile_program(
    stablehlo: str,
    topology: TpuTopology,
    argument_shardings: Sequence[Optional[str]],
    result_shardings: Sequence[str],
    aliases: Mapping[int, int],
    effort: float = 0.0,
    int64_as_int32: bool = False,
) -> CompiledStep:
    """Compile ``stablehlo`` (torch_xla's text of one SPMD program) for ``topology``.

    ``argument_shardings``: each argument's HLO sharding (None: as traced); ``result_shardings``:
    each result's; ``aliases``: result index -> the argument whose buffer it reuses (donation).
    ``effort``: XLA's execution-time optimization effort, -1 (least) to 1; 0 is the compiler's
    default. -1 compiles in less of the host's time and memory: Llama 3 8B unrolled over 64 v5p
    chips (fsdp=64) in 144 s and 20 GB, where 0 takes more than this 24 GB host; its program holds
    more HBM (at 8 layers 9.1 GiB a chip against 8.2 at 0).
    ``int64_as_int32``: compile the program's 64-bit integer tensors (token ids, positions, indices)
    as 32-bit ones. libtpu 0.0.21 aborts the process on torch_xla's layer scan otherwise (a failed
    check in its windowing pass, on the two 32-bit words a TPU emulates a 64-bit integer with,
    inside the loop); the step's floating-point tensors are unchanged, its integer ones half as large.
    Raises ``DoesNotFit`` when the compiler runs out of a chip's memory.
    """
    devices = topology_devices(topology)  # and with them JAX and libtpu, or the extra to install
    import jax
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        module = ir.Module.parse(_int64_as_int32(stablehlo) if int64_as_int32 else stablehlo)
        main = next(op for op in module.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main")
        traced = list(ir.ArrayAttr(main.attributes["arg_attrs"])) if "arg_attrs" in main.attributes else []
        int32 = ir.IntegerType.get_signless(32)
        arguments = []
        for index, sharding in enumerate(argument_shardings):
            attributes = {named.name: named.attr for named in ir.DictAttr(traced[index])} if traced else {}
            if sharding is not None:
                attributes["mhlo.sharding"] = ir.StringAttr.get(sharding)
            arguments.append(ir.DictAttr.get(attributes))
        for result, argument in aliases.items():
            donated = {named.name: named.attr for named in ir.DictAttr(arguments[argument])}
            arguments[argument] = ir.DictAttr.get(donated | {"tf.aliasing_output": ir.IntegerAttr.get(int32, result)})
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(arguments)
        main.attributes["res_attrs"] = ir.ArrayAttr.get(
            [ir.DictAttr.get({"mhlo.sharding": ir.StringAttr.get(sharding)}) for sharding in result_shardings]
        )
        bytecode = mlir.module_to_bytecode(module)
    count = len(devices)
    # torch_xla writes GSPMD's mhlo.sharding: the compile uses GSPMD's partitioner, not JAX's default Shardy.
    jax.config.update("jax_use_shardy_partitioner", False)
    options = compiler.get_compile_options(
        num_replicas=1, num_partitions=count, device_assignment=np.array([d.id for d in devices]).reshape(1, count)
    )
    options.executable_build_options.exec_time_optimization_effort = effort
    started = time.perf_counter()
    try:  # libtpu's own words reach the terminal here: a failed check in the compiler aborts the process
        executable = devices[0].client.compile(bytecode, xla_client.DeviceList(tuple(devices)), options)
    except Exception as error:
        message = str(error)
        if "RESOURCE_EXHAUSTED" in message or ("memory" in message.lower() and "hbm" in message.lower()):
            raise DoesNotFit(topology.name, message.strip(), time.perf_counter() - started) from error
        raise
    seconds = time.perf_counter() - started
    memory = executable.get_compiled_memory_stats()
    cost = _cost_analysis(executable)
    hlo = "\n".join(hlo_module.to_string() for hlo_module in executable.hlo_modules())
    return CompiledStep(
        topology=topology.name,
        devices=count,
        device_kind=devices[0].device_kind,
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        temporary_bytes=memory.temp_size_in_bytes,
        code_bytes=memory.generated_code_size_in_bytes,
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        collectives=collectives_of(hlo),
        compile_seconds=seconds,
        effort=effort,
        int64_as_int32=int64_as_int32,
        aliased=aliases_of(hlo),
    )


def _cost_analysis(executable: Any) -> dict[str, float]:
    analysis = executable.cost_analysis()
    return analysis[0] if isinstance(analysis, list) else dict(analysis)


def _array_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape (an array, or a tuple: the largest of its arrays), without layout padding."""
    sizes = [
        _ELEMENT_BYTES.get(dtype, 4) * int(np.prod([int(n) for n in dims.split(",") if n] or [1]))
        for dtype, dims in _ARRAY.findall(shape_text)
    ]
    return max(sizes, default=0)


def collectives_of(hlo: str) -> dict[str, Collective]:
    """The collectives in a compiled module's text, by kind: instances and bytes.

    A reduce-scatter the TPU compiler writes as an all-reduce and a slice fused together (a
    computation named ``all-reduce-scatter``) counts as a reduce-scatter.
    """
    shapes: dict[str, str] = {}
    instances: dict[str, list[int]] = {}  # kind -> each instance's bytes
    computation = ""
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            computation = line.split(" ", 1)[0].lstrip("%")
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, shape, opcode, operands = match.groups()
        shapes[name] = shape
        kind = opcode.removesuffix("-start")
        if kind not in COLLECTIVES:
            continue
        if kind == "all-reduce" and computation.startswith("all-reduce-scatter"):
            kind = "reduce-scatter"
        references = re.findall(r"%([\w.-]+)", operands)
        operand_bytes = max((_array_bytes(shapes.get(ref, "")) for ref in references), default=0)
        instances.setdefault(kind, []).append(max(operand_bytes, _array_bytes(shape)))
    return {kind: Collective(kind, len(sizes), sum(sizes)) for kind, sizes in instances.items()}


def aliases_of(hlo: str) -> list[tuple[int, int]]:
    """(result, argument) pairs of the compiled module's ``input_output_alias``."""
    header = hlo.split("\n", 1)[0].partition("input_output_alias=")[2]
    return [(int(result), int(argument)) for result, argument in re.findall(r"\{(\d+)\}: \((\d+), \{\}", header)]


def _int64_as_int32(stablehlo: str) -> str:
    """The program with every ``i64`` tensor type made ``i32`` and its hex-encoded constants
    re-encoded; a value past 32 bits wraps, which a compile-only check can bear (it reads shapes,
    not values). Attributes such as dimension lists (``array<i64: ...>``) are no tensors and stay."""

    def constant(match: re.Match) -> str:
        values = np.frombuffer(bytes.fromhex(match.group(1)), dtype="<i8")
        return f'dense<"0x{values.astype("<i4").tobytes().hex().upper()}"> : tensor<{match.group(2)}i64>'

    stablehlo = re.sub(r'dense<"0x([0-9A-Fa-f]+)"> : tensor<((?:\d+x)*)i64>', constant, stablehlo)
    return re.sub(r"tensor<((?:\d+x)*)i64>", r"tensor<\1i32>", stablehlo)
