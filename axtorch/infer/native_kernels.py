"""axtorch's decode kernels, compiled on the machine that runs them: a batch-1 matrix-vector
product (``matvec.c``) and a whole transformer layer's step for one token (``decode_layer.c``).

BLAS libraries tune their matrix-vector products per CPU vendor and model, and on some CPUs they
read weights well below the memory's rate (docs/benchmarks.md: 35-60% on an AMD EPYC). The C
files are short, depend on no torch header (so one build serves every torch version) and are
compiled with the system's C compiler for this CPU (``-march=native``) on first use, into one
library in ``$XDG_CACHE_HOME/axtorch/kernels`` (``~/.cache`` by default). The library's name holds
a digest of the sources, the compiler, the flags and the CPU's model and features, so a home
directory shared by different machines holds one build for each. Without a compiler, or if the
build fails, ``load_library`` gives None and decoding keeps torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("matvec.c", "decode_layer.c"))
#: What the sources include: part of the digest, not of the command.
HEADERS = (Path(__file__).with_name("kernels.h"),)
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-shared", "-fPIC")
#: After the sources: the math library, for the activations and the softmax.
LIBRARIES = ("-lm",)
#: Threads through OpenMP where the compiler has it; a compiler without it builds a one-thread kernel.
OPENMP = ("-fopenmp",)

#: ``matvec(weight, x, bias)``: ``weight @ x + bias`` for a contiguous float32 ``[rows, cols]``
#: weight and one contiguous float32 row ``x``, on torch's thread count.
MatVec = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def compiler() -> Optional[list[str]]:
    """The C compiler's command: ``$CC``, else the one Python was built with, else ``cc``; None if absent."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc"):
        if candidate:
            command = shlex.split(candidate)
            if shutil.which(command[0]):
                return command
    return None


def _cpu_identity() -> str:
    """The CPU's model and feature flags (Linux), or the platform's name: what ``-march=native`` builds for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(dict.fromkeys(line for line in lines if line.split(":")[0].strip() in wanted))


def _build(command: list[str], directory: Path) -> Optional[Path]:
    """The compiled library, built once per sources, compiler, flags and CPU; None if it cannot be built."""
    version = subprocess.run([*command, "--version"], capture_output=True, text=True).stdout
    sources = b"\0".join(path.read_bytes() for path in SOURCES + HEADERS)
    for flags in (FLAGS + OPENMP, FLAGS):
        digest = hashlib.sha256(b"\0".join(s.encode() for s in (version, *flags, _cpu_identity())) + sources)
        library = directory / f"kernels-{digest.hexdigest()[:16]}.so"
        if library.exists():
            return library
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            built = Path(scratch) / library.name
            arguments = [*command, *flags, *map(str, SOURCES), *LIBRARIES, "-o", str(built)]
            result = subprocess.run(arguments, capture_output=True, text=True)
            if result.returncode == 0:
                os.replace(built, library)  # whole or absent, for processes that build at once
                return library
        logger.info("building the decode kernels with %s failed: %s", " ".join(flags), result.stderr.strip()[-500:])
    return None


def kernel_directory() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "axtorch" / "kernels"


@functools.cache
def load_library() -> Optional[ctypes.CDLL]:
    """This machine's compiled kernels (built on the first call of a process, or loaded), or None."""
    command = compiler()
    if command is None:
        logger.info("no C compiler ($CC or cc): decoding keeps torch's kernels")
        return None
    try:
        library = _build(command, kernel_directory())
        return None if library is None else ctypes.CDLL(str(library))
    except OSError as error:  # a read-only cache directory, a library that does not load
        logger.info("no compiled decode kernels: %s", error)
        return None


@functools.cache
def load_matvec() -> Optional[MatVec]:
    """This machine's compiled product (``load_library``), or None."""
    library = load_library()
    if library is None:
        return None
    function = library.axtorch_matvec
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long, ctypes.c_long, ctypes.c_int]
    function.restype = None

    def matvec(weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        rows, cols = weight.shape
        out = x.new_empty(*x.shape[:-1], rows)
        bias_address = None if bias is None else bias.data_ptr()
        function(weight.data_ptr(), x.data_ptr(), bias_address, out.data_ptr(), rows, cols, torch.get_num_threads())
        return out

    return matvec


class NativeLinear(nn.Module):
    """``x @ W.T + b`` in float32 by this machine's compiled product (``load_matvec``) for one
    row of ``x``, by torch's ``linear`` for more rows or where gradients are wanted. It holds the
    weight itself, not a copy."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        matvec = load_matvec()
        if matvec is None:
            raise RuntimeError("no compiled decode kernels on this machine (see axtorch.infer.native_kernels)")
        self.matvec = matvec
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.in_features = weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != self.in_features or x.dtype != torch.float32 or (torch.is_grad_enabled() and x.requires_grad):
            return F.linear(x, self.weight, self.bias)
        return self.matvec(self.weight, x.contiguous(), self.bias)
