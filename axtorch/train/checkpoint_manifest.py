"""A checkpoint's manifest: the size and digest of every file, so a checkpoint is either whole or refused.

Every file is fsynced before the manifest lists it; the manifest is written last, fsynced, and the
directory is fsynced before and after its rename into place. A checkpoint without a manifest, or
whose files differ from it in name, size or digest, fails verification, and resuming falls back
to the newest one that passes. The digest is XXH3-128: it catches flipped bits, truncation and torn
writes (the failures of disks and networks, not of adversaries) at about 19 GB/s a core here: about
4% of a save of ``llama_bench``, where SHA-256 (1.7 GB/s) took about 15% (``benchmarks/checkpoint_cost.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import xxhash

MANIFEST_FILE = "manifest.json"
_FORMAT = 1
_CHUNK = 8 * 2**20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or none can be trusted: says which, and what failed."""


def fsync_file(path: Path) -> None:
    with path.open("rb") as file:
        os.fsync(file.fileno())


def fsync_directory(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def file_record(path: Path) -> dict[str, Any]:
    """``{"size", "xxh3_128"}`` of a file, read in chunks."""
    digest = xxhash.xxh3_128()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return {"size": path.stat().st_size, "xxh3_128": digest.hexdigest()}


def seal_files(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """fsync each named file of ``directory`` and return its manifest record."""
    records = {}
    for name in names:
        fsync_file(directory / name)
        records[name] = file_record(directory / name)
    return records


def write_manifest(directory: Path, records: dict[str, dict[str, Any]]) -> None:
    path = directory / MANIFEST_FILE
    path.write_text(json.dumps({"format": _FORMAT, "files": dict(sorted(records.items()))}, indent=1))
    fsync_file(path)
    fsync_directory(directory)


def _is_plain_name(name: object) -> bool:
    """A file name that stays inside the checkpoint directory: no separators, no ``..``."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def verify_checkpoint(directory: Path, referenced: set[str] | None = None) -> list[str]:
    """What is wrong with the checkpoint in ``directory``; empty when every file matches its manifest.

    ``referenced`` are the files its indexes point to: each must be one the manifest vouches for.
    """
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
    except FileNotFoundError:
        return [f"no {MANIFEST_FILE} (an interrupted save, or written by an axtorch that kept none)"]
    except (ValueError, KeyError, TypeError) as error:
        return [f"{MANIFEST_FILE} is unreadable ({type(error).__name__}: {error})"]
    problems = []
    for name, record in files.items():
        if not _is_plain_name(name):
            problems.append(f"{MANIFEST_FILE} names {name!r}, outside the checkpoint directory")
            continue
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != record.get("size"):
            problems.append(f"{name} has {path.stat().st_size} bytes, the manifest says {record.get('size')}")
        elif file_record(path)["xxh3_128"] != record.get("xxh3_128"):
            problems.append(f"{name} does not match its xxh3-128 digest (its bytes changed)")
    for name in sorted((referenced or set()) - set(files)):
        problems.append(f"an index refers to {name!r}, which the manifest does not list")
    return problems
