"""What a process knows of its machine's CPU, and where axtorch keeps what it measures there."""

from pathlib import Path

import pytest

from axtorch.host import cpu
from axtorch.host.cache import axtorch_cache


@pytest.fixture
def no_cpuinfo(monkeypatch):
    real_read_text = Path.read_text

    def read_text(path, *args, **kwargs):
        if str(path) == "/proc/cpuinfo":
            raise FileNotFoundError(path)
        return real_read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    cpu._cpuinfo_lines.cache_clear()
    yield
    cpu._cpuinfo_lines.cache_clear()


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="Linux's /proc/cpuinfo")
def test_a_linux_cpu_is_identified_by_its_model_and_features_once_for_all_its_cores():
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    identity = cpu.cpu_identity().splitlines()
    assert len(identity) == len(set(identity)) and set(identity) <= set(lines)
    assert any(line.startswith(("flags", "Features")) for line in identity), identity
    vendors = {line.partition(":")[2].strip() for line in lines if line.startswith("vendor_id")}
    assert {cpu.cpu_vendor()} == (vendors or {""})


def test_a_machine_without_proc_cpuinfo_is_identified_by_its_platform_and_has_no_vendor(no_cpuinfo):
    import platform

    assert cpu.cpu_identity() == platform.machine() + platform.processor()
    assert cpu.cpu_vendor() == ""


def test_the_cache_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert axtorch_cache() == tmp_path / "axtorch"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert axtorch_cache() == Path.home() / ".cache" / "axtorch"
