"""axtorch's decode kernels, built on the machine that runs them: the weight products of a decode
step of 1 to 8 rows (``matvec.c``) and a whole transformer layer's step for one token of each row
(``decode_layer.c``), registered as torch operators (``axtorch::matvec`` here,
``axtorch::decode_layer`` in ``native_layers``). Both read a weight matrix as float32 rows or as
block codes (``MatrixStruct``, ``weight_codes``).

BLAS libraries tune their matrix-vector products per CPU vendor and model, and on some CPUs they
read weights well below the memory's rate (docs/benchmarks.md: 35-60% on an AMD EPYC). The sources
are short and include no torch header, so a build takes about a second. torch's extension builder
(``torch.utils.cpp_extension``, with ninja) compiles them for this CPU (``-march=native``) on first
use, into ``$XDG_CACHE_HOME/axtorch/kernels`` (``~/.cache`` by default), one build directory per
digest of the sources, the compiler, the flags, torch's version (the library links torch) and the
CPU's model and features, so a home directory shared by different machines holds one build for
each, and processes that build at once wait on the builder's lock. Without a compiler or ninja,
or if the build fails, ``load_library`` gives None and decoding keeps torch's kernels.

The operators have fake implementations, so ``torch.compile`` and ``torch.export`` trace through
them and see what they write. Eager calls, the batch-1 hot path, skip the dispatcher (about 40 us
a call, against a layer step of a few hundred) and bump the written tensors' versions themselves.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Optional
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import cpp_extension

from axtorch.host.cache import axtorch_cache
from axtorch.host.cpu import cpu_identity, cpu_vendor
from axtorch.infer.weight_codes import WeightCodes

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("matvec.c", "decode_layer.c"))
#: What the sources include: part of the digest, not of the command.
HEADERS = (Path(__file__).with_name("kernels.h"),)
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast")
#: Linked after the sources: the math library, for the activations and the softmax.
LIBRARIES = ("-lm",)
#: Threads through OpenMP where the compiler has it; a compiler without it builds a one-thread kernel.
OPENMP = ("-fopenmp",)

#: The most rows of ``x`` the compiled product takes (``MAX_ROWS`` in ``kernels.h``): a decode step
#: of up to 8 sequences.
MAX_ROWS = 8
#: ``matvec(weight, x, bias, matrix=None)``: ``x @ weight.T + bias`` for a contiguous float32
#: ``[rows, cols]`` weight, read as ``matrix`` says where given (``matrix_struct``: its block codes,
#: ``weight_codes``), and 1 to ``MAX_ROWS`` contiguous float32 rows ``x [..., cols]``, on torch's
#: thread count.
MatVec = Callable[..., torch.Tensor]
NO_KERNELS = "no compiled decode kernels on this machine (see axtorch.infer.native_kernels)"


def compiler() -> Optional[list[str]]:
    """The C++ compiler torch's extension builder runs (``$CXX``, else ``c++``); None if absent."""
    command = shlex.split(cpp_extension.get_cxx_compiler())
    return command if command and shutil.which(command[0]) else None


def prefetch_flags(vendor: str) -> tuple[str, ...]:
    """How the kernels prefetch on ``vendor``'s CPUs: non-temporally on AMD's, the AMD EPYC host's
    best; into every cache level elsewhere, where non-temporal prefetches halved an Intel Xeon's
    rate (kernels.h)."""
    return ("-DPREFETCH_LOCALITY=0",) if vendor == "AuthenticAMD" else ()


def _build(command: list[str], directory: Path) -> Optional[Path]:
    """The library built by ``command`` (with OpenMP if it can), once per sources, compiler, flags,
    torch version and CPU; None if it cannot be built (a failed build leaves nothing behind)."""
    version = subprocess.run([*command, "--version"], capture_output=True, text=True).stdout
    sources = b"\0".join(path.read_bytes() for path in SOURCES + HEADERS)
    error, prefetch, cpu = "", prefetch_flags(cpu_vendor()), cpu_identity()
    for threads in (OPENMP, ()):
        flags = FLAGS + prefetch + threads
        identity = (version, *flags, torch.__version__, cpu)
        digest = hashlib.sha256(b"\0".join(s.encode() for s in identity) + sources).hexdigest()[:16]
        name = f"axtorch_kernels_{digest}"
        build = directory / name
        build.mkdir(parents=True, exist_ok=True)
        try:
            with mock.patch.dict(os.environ, {"CXX": shlex.join(command)}):
                # Its path, not ours to guess: a name built before in this process (in another
                # directory) is built again as `<name>_v1`.
                library = cpp_extension.load(
                    name,
                    [str(source) for source in SOURCES],
                    extra_cflags=list(flags),
                    extra_ldflags=[*LIBRARIES, *threads],
                    build_directory=str(build),
                    is_python_module=False,
                )
            return Path(library)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as failure:
            error = str(failure)
            shutil.rmtree(build, ignore_errors=True)
    logger.info("building the decode kernels failed: %s", error.strip()[-500:])
    return None


def kernel_directory() -> Path:
    return axtorch_cache() / "kernels"


@functools.cache
def load_library() -> Optional[ctypes.CDLL]:
    """This machine's compiled kernels (built on the first call of a process, or loaded), or None."""
    command = compiler()
    if command is None:
        logger.info("no C++ compiler ($CXX or c++): decoding keeps torch's kernels")
        return None
    if not cpp_extension.is_ninja_available():
        logger.info("no ninja (torch's extension builder runs it): decoding keeps torch's kernels")
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
    return None if library is None else matvec_of(library)


@functools.cache
def reads_codes() -> bool:
    """Whether this machine's kernels read block codes at speed (``axtorch_reads_codes``: built for AVX-512)."""
    library = load_library()
    return library is not None and bool(library.axtorch_reads_codes())


class MatrixStruct(ctypes.Structure):
    """``kernels.h``'s ``matrix_t``: a weight matrix as float32 rows or as block codes."""

    _fields_ = [*((name, ctypes.c_void_p) for name in ("weight", "codes", "scales")), ("bits", ctypes.c_long)]


def code_bits(weight: torch.Tensor, codes: Optional[torch.Tensor]) -> int:
    """The width of ``weight``'s codes (``WeightCodes.bits``, read from the codes' shape), 32 without codes."""
    return 32 if codes is None else codes.shape[1] * 8 // weight.shape[1]


def matrix_struct(weight: torch.Tensor, codes: Optional[torch.Tensor], scales: Optional[torch.Tensor]) -> MatrixStruct:
    """The ``matrix_t`` of ``weight``, read as its ``codes`` and ``scales`` where it has them."""
    address = None if codes is None or scales is None else (codes.data_ptr(), scales.data_ptr())
    addresses = (None, None) if address is None else address
    return MatrixStruct(weight.data_ptr(), *addresses, code_bits(weight, codes))


def matvec_of(library: ctypes.CDLL) -> MatVec:
    """The product a built library holds, as a function of tensors."""
    function = library.axtorch_matvec
    function.argtypes = [ctypes.POINTER(MatrixStruct)] + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    function.restype = None

    def matvec(
        weight: torch.Tensor,
        x: torch.Tensor,
        bias: Optional[torch.Tensor],
        matrix: Optional[MatrixStruct] = None,
    ) -> torch.Tensor:
        rows, cols = weight.shape
        out = x.new_empty(*x.shape[:-1], rows)
        bias_address = None if bias is None else bias.data_ptr()
        count = x.numel() // cols
        if x.shape[-1] != cols or not 1 <= count <= MAX_ROWS:  # the kernel would read past x
            raise ValueError(f"the compiled product takes 1 to {MAX_ROWS} rows of {cols} features, got {list(x.shape)}")
        if matrix is None:
            matrix = matrix_struct(weight, None, None)
        function(
            ctypes.byref(matrix), x.data_ptr(), bias_address, out.data_ptr(), rows, cols, count, torch.get_num_threads()
        )
        return out

    return matvec


def tracing(x: torch.Tensor) -> bool:
    """Whether ``x`` flows through a trace (``torch.compile``, ``torch.export``, fake tensors),
    which must see the kernels as operators, rather than through an eager call."""
    return torch.compiler.is_compiling() or type(x) is not torch.Tensor


@torch.library.custom_op("axtorch::matvec", mutates_args=())
def matvec_operator(
    weight: torch.Tensor,
    x: torch.Tensor,
    bias: Optional[torch.Tensor],
    codes: Optional[torch.Tensor] = None,
    scales: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``load_matvec``'s product as a torch operator: ``weight`` read as its ``codes`` and
    ``scales`` (``WeightCodes``) where given."""
    matvec = load_matvec()
    if matvec is None:
        raise RuntimeError(NO_KERNELS)
    return matvec(weight, x.contiguous(), bias, matrix=matrix_struct(weight, codes, scales))


@matvec_operator.register_fake
def _(weight: torch.Tensor, x: torch.Tensor, *rest: object) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class NativeLinear(nn.Module):
    """``x @ W.T + b`` in float32 by this machine's compiled product (``load_matvec``) for up to
    ``MAX_ROWS`` rows of ``x`` (a decode step), by torch's ``linear`` for more rows (a prefill) or
    where gradients are wanted. It holds the weight itself, not a copy; the product reads it as
    its block ``codes`` where given (``weight_codes``: the same weights in fewer bytes; only where
    ``reads_codes``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, codes: Optional[WeightCodes] = None):
        super().__init__()
        matvec = load_matvec()
        if matvec is None:
            raise RuntimeError(NO_KERNELS)
        self.matvec = matvec
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.in_features = weight.shape[1]
        self.codes = codes
        #: What the eager product passes, built once: it points into the weight and codes held here.
        self.matrix = matrix_struct(self.weight, *self.code_tensors)

    @property
    def code_tensors(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The codes and block scales the product reads, (None, None) for the float32 weight."""
        return (None, None) if self.codes is None else (self.codes.codes, self.codes.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            not 0 < x.numel() <= MAX_ROWS * self.in_features
            or x.shape[-1] != self.in_features
            or x.dtype != torch.float32
            or (torch.is_grad_enabled() and x.requires_grad)
        ):
            return F.linear(x, self.weight, self.bias)
        if tracing(x):
            return torch.ops.axtorch.matvec(self.weight, x, self.bias, *self.code_tensors)
        return self.matvec(self.weight, x.contiguous(), self.bias, matrix=self.matrix)
