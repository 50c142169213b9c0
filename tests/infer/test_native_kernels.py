"""axtorch's own batch-1 product (``native_kernels``): torch's ``linear`` on any shape and thread
count, torch's kernel wherever it does not apply, one build per machine, in torch's OpenMP
runtime, and decoding without it where no compiler is."""

import ctypes
import json
import logging
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.host.cpu import cpu_identity
from axtorch.infer import cpu_weights, generate_ids, native_kernels
from axtorch.infer.cpu_weights import DecodeKernel, NativeLinear
from axtorch.infer.native_kernels import compiler, load_matvec
from axtorch.infer.weight_codes import encode
from axtorch.train.trainer import build_model
from tests.gguf_blocks import expanded

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler on this machine")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 5, 64, 67, 1000])
@pytest.mark.parametrize("cols", [1, 7, 64, 65, 576, 1000])
@pytest.mark.parametrize("count", [1, 3, 8])
def test_the_product_is_torch_linear_on_any_shape_and_thread_count(rows, cols, threads, count):
    """``count`` rows of x: a decode step of that many sequences, [count, 1, cols]."""
    generator = torch.Generator().manual_seed(rows * cols)
    shapes = ((rows, cols), (count, 1, cols), (rows,))
    weight, x, bias = (torch.randn(shape, generator=generator) for shape in shapes)
    matvec = load_matvec()
    assert matvec is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (None, bias):
            torch.testing.assert_close(matvec(weight, x, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-5 * cols**0.5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("count", [1, 2, 3, 8])
@pytest.mark.parametrize(("kind", "bits"), [("Q4_1", 4), ("Q8_0", 8)])
def test_weights_with_block_codes_are_read_as_codes_and_multiply_as_torch_linear(kind, bits, count, threads):
    generator = torch.Generator().manual_seed(count)
    weight = expanded(torch.randn(67, 576, generator=generator), kind)
    x, bias = torch.randn(count, 1, 576, generator=generator), torch.randn(67, generator=generator)
    codes = encode(weight)
    assert codes is not None and codes.bits == bits
    linear = NativeLinear(weight, bias, codes)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.testing.assert_close(linear(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5 * 576**0.5)
    finally:
        torch.set_num_threads(before)


def test_more_rows_and_gradients_go_to_torch_linear(monkeypatch):
    weight, bias = torch.randn(12, 8), torch.randn(12)
    native = NativeLinear(weight, bias)
    monkeypatch.setattr(native, "matvec", None)  # a call of the compiled product would fail
    rows = torch.randn(3, 3, 8)  # 9 rows, more than MAX_ROWS
    torch.testing.assert_close(native(rows), F.linear(rows, weight, bias), rtol=0, atol=0)
    empty = torch.randn(0, 1, 8)
    assert native(empty).shape == (0, 1, 12)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # torch's own error, not a bad read
        native(torch.randn(2, 1, 4))
    x = torch.randn(1, 1, 8, requires_grad=True)
    native(x).sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).view(1, 1, 8))


def test_the_compiled_product_refuses_rows_it_would_read_past():
    matvec = load_matvec()
    weight = torch.randn(12, 8)
    for x in (torch.randn(9, 8), torch.randn(0, 8), torch.randn(2, 4)):
        with pytest.raises(ValueError, match="takes 1 to 8 rows of 8 features"):
            matvec(weight, x, None)


def test_it_is_built_once_per_machine(tmp_path):
    command = compiler()
    assert command is not None
    library = native_kernels._build(command, tmp_path)
    assert library is not None
    built = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*") if path.is_file()}
    assert native_kernels._build(command, tmp_path) == library
    assert {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*") if path.is_file()} == built
    assert [p.name for p in tmp_path.iterdir()] == [library.parent.name]


@pytest.mark.journey
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's memory map (Linux)")
def test_it_runs_in_the_openmp_runtime_torch_loaded():
    """Loading the library maps no OpenMP runtime besides the ones already there: its libgomp.so.1
    is torch's. (Other packages may bring their own, renamed: sentencepiece's wheel does.)"""
    program = (
        "import json, torch\n"
        "from axtorch.infer.native_kernels import load_matvec\n"
        "def runtimes():\n"
        "    return {l.split()[-1] for l in open('/proc/self/maps') if 'omp' in l.rsplit('/', 1)[-1]}\n"
        "before = runtimes()\n"
        "assert load_matvec() is not None\n"
        "print(json.dumps({'before': sorted(before), 'added': sorted(runtimes() - before)}))\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    maps = json.loads(result.stdout)
    assert any("torch" in path for path in maps["before"]) and maps["added"] == [], maps


def test_without_a_compiler_decoding_keeps_torchs_kernels(monkeypatch, caplog):
    monkeypatch.setattr(native_kernels, "compiler", lambda: None)
    monkeypatch.setattr(native_kernels, "load_library", native_kernels.load_library.__wrapped__)
    monkeypatch.setattr(native_kernels, "load_matvec", native_kernels.load_matvec.__wrapped__)
    monkeypatch.setattr(cpu_weights, "load_matvec", native_kernels.load_matvec)
    with caplog.at_level(logging.INFO, logger=native_kernels.__name__):
        assert DecodeKernel.native not in cpu_weights.available_kernels()
    assert "no C++ compiler" in caplog.text
    torch.manual_seed(0)
    model = build_model(load_experiment_config(["experiment=debug"]), torch.device("cpu")).eval()
    assert generate_ids(model, [[5, 17, 300]], 6) == generate_ids(model, [[5, 17, 300]], 6, pack=False)
    assert cpu_weights.default_kernel() is DecodeKernel.linear


def test_a_compiler_that_fails_leaves_no_library(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_DONT_CHECK_COMPILER_ABI", "1")  # torch's check of the compiler is not the point
    failing = tmp_path / "c++"
    failing.write_text(
        "#!/bin/sh\n"
        '[ "$1" = --version ] && { echo "c++ (a compiler that cannot compile) 1.0"; exit 0; }\n'
        "echo 'c++: error: unsupported' >&2\nexit 1\n"
    )
    failing.chmod(0o755)
    with caplog.at_level(logging.INFO, logger=native_kernels.__name__):
        assert native_kernels._build([str(failing)], tmp_path / "kernels") is None
    assert "unsupported" in caplog.text
    assert list((tmp_path / "kernels").iterdir()) == []  # neither build's directory


def test_a_cache_directory_that_cannot_be_written_leaves_torchs_kernels(tmp_path, monkeypatch, caplog):
    (tmp_path / "not-a-directory").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-directory"))
    with caplog.at_level(logging.INFO, logger=native_kernels.__name__):
        assert native_kernels.load_library.__wrapped__() is None
    assert "no compiled decode kernels" in caplog.text


def test_amd_cpus_prefetch_non_temporally_others_into_every_cache(tmp_path, monkeypatch):
    assert native_kernels.prefetch_flags("AuthenticAMD") == ("-DPREFETCH_LOCALITY=0",)
    assert native_kernels.prefetch_flags("GenuineIntel") == native_kernels.prefetch_flags("") == ()
    # Each vendor's setting builds a library of its own (the flag is part of the build's identity).
    built = {}
    for vendor in ("AuthenticAMD", "GenuineIntel"):
        monkeypatch.setattr(native_kernels, "cpu_vendor", lambda vendor=vendor: vendor)
        built[vendor] = native_kernels._build(compiler(), tmp_path)
    assert None not in built.values() and built["AuthenticAMD"] != built["GenuineIntel"], built


@pytest.mark.skipif("avx512f" not in cpu_identity(), reason="an x86 CPU with AVX-512, whose build can leave it out")
def test_the_avx2_build_multiplies_as_torch_linear_at_every_row_count(tmp_path, monkeypatch):
    """Where the CPU has AVX-512 the kernels take 16-float vectors; elsewhere 8, with other
    accumulators and no two-row products at 7 and 8 rows of x. This builds that second variant."""
    native = native_kernels._build(compiler(), tmp_path / "native")
    monkeypatch.setattr(native_kernels, "FLAGS", (*native_kernels.FLAGS, "-mno-avx512f"))
    library = native_kernels._build(compiler(), tmp_path / "avx2")
    assert library is not None and native is not None
    assert library.read_bytes() != native.read_bytes(), "the flag left the AVX-512 build unchanged"
    avx2 = ctypes.CDLL(str(library))
    assert avx2.axtorch_reads_codes() == 1
    matvec = native_kernels.matvec_of(avx2)
    generator = torch.Generator().manual_seed(0)
    for rows, cols in ((1, 7), (5, 65), (67, 576)):
        weight, bias = torch.randn(rows, cols, generator=generator), torch.randn(rows, generator=generator)
        for count in range(1, native_kernels.MAX_ROWS + 1):
            x = torch.randn(count, 1, cols, generator=generator)
            torch.testing.assert_close(matvec(weight, x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    for kind in ("Q4_1", "Q8_0"):  # block codes, 8 floats at a time
        weight = expanded(torch.randn(67, 576, generator=generator), kind)
        codes = encode(weight)
        assert codes is not None
        matrix = native_kernels.matrix_struct(weight, codes.codes, codes.scales)
        for count in range(1, native_kernels.MAX_ROWS + 1):
            x = torch.randn(count, 1, 576, generator=generator)
            torch.testing.assert_close(matvec(weight, x, None, matrix), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_a_build_without_avx2_keeps_the_float32_weights(tmp_path, monkeypatch):
    """Without AVX2 the codes widen at half the float32 rate (kernels.h): that build says it does not read them."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 flag")
    monkeypatch.setattr(native_kernels, "FLAGS", (*native_kernels.FLAGS, "-mno-avx512f", "-mno-avx2"))
    library = native_kernels._build(compiler(), tmp_path)
    assert library is not None
    assert ctypes.CDLL(str(library)).axtorch_reads_codes() == 0
