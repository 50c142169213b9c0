"""Checkpoints: safetensors pieces plus an index, JSON trainer state, atomic directories, optional async.

Layout of ``<run_dir>/checkpoints/step_<8-digit step>/``::

    model.safetensors                   one process: every parameter, whole (loadable by HF tools)
    model-00000-of-00004.safetensors    several processes: each writes the blocks it owns
    model.safetensors.index.json        per tensor: global shape and the pieces (file, offsets, shape)
    optimizer*.safetensors (+ index)    "<param name>/<state key>" tensors, stored the same way
    trainer_state.json                  step, data position, RNG states, config digests
    manifest.json                       every file's size and XXH3-128 digest, written last

Every process writes only its own blocks (``tensor_shards``), so no host ever gathers a whole
sharded model, and any mesh can load what any other mesh saved. A checkpoint is assembled in a
hidden temporary directory, fsynced and renamed into place, so readers only ever see complete
ones; the manifest (``checkpoint_manifest``) lets a resume refuse one whose bytes changed since.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, Protocol, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from axtorch.parallel.side_channel import Coordinator
from axtorch.parallel.tensor_shards import Piece, load_into, owned_pieces, read_block
from axtorch.train.checkpoint_manifest import (
    CheckpointError,
    fsync_directory,
    seal_files,
    verify_checkpoint,
    write_manifest,
)

MODEL = "model"
OPTIMIZER = "optimizer"
TRAINER_STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
T = TypeVar("T")


class Collective(Coordinator, Protocol):
    """What a multi-process save needs from a backend."""

    def owned_pieces(self, tensor: torch.Tensor) -> list[Piece]:
        """The blocks of ``tensor`` that this process stores (none, its own, or one per local device)."""

    def side_channel(self) -> Coordinator:
        """A coordinator for the writer thread, apart from the training's collectives."""


class LocalCollective:
    rank = 0
    world_size = 1

    def barrier(self) -> None:
        pass

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def owned_pieces(self, tensor: torch.Tensor) -> list[Piece]:
        return owned_pieces(tensor, self.rank)

    def side_channel(self) -> Coordinator:
        return self


def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def index_file(prefix: str) -> str:
    return f"{prefix}.safetensors.index.json"


def _shard_file(prefix: str, rank: int, world_size: int) -> str:
    return f"{prefix}.safetensors" if world_size == 1 else f"{prefix}-{rank:05d}-of-{world_size:05d}.safetensors"


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Optimizer state as ``"<param name>/<key>"`` tensors, using the param groups' ``names``."""
    tensors = {}
    for group in optimizer.param_groups:
        for name, param in zip(group["names"], group["params"]):
            for key, value in optimizer.state.get(param, {}).items():
                tensors[f"{name}/{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return tensors


def _pieces(tensors: dict[str, torch.Tensor], collective: Collective) -> dict[str, list[Piece]]:
    return {name: pieces for name, t in tensors.items() if (pieces := collective.owned_pieces(t))}


def _piece_key(name: str, piece: Piece, count: int) -> str:
    """The safetensors key of a piece: the tensor's name, made unique when a file holds several."""
    return name if count == 1 else f"{name}@{'_'.join(map(str, piece.offsets))}"


def _write_own_pieces(directory: Path, prefix: str, pieces: dict[str, list[Piece]], rank: int, world_size: int):
    """Write this process's pieces into its file; return their index entries (without the other ranks')."""
    file = _shard_file(prefix, rank, world_size)
    stored: dict[str, torch.Tensor] = {}
    described: dict[str, dict[str, Any]] = {}
    for name, name_pieces in pieces.items():
        first = name_pieces[0]
        entry: dict[str, Any] = {
            "shape": list(first.global_shape),
            "dtype": str(first.tensor.dtype).removeprefix("torch."),
            "pieces": [],
        }
        for piece in name_pieces:
            key = _piece_key(name, piece, len(name_pieces))
            stored[key] = piece.tensor
            entry["pieces"].append(
                {"file": file, "key": key, "offsets": list(piece.offsets), "shape": list(piece.tensor.shape)}
            )
        described[name] = entry
    save_file(stored, directory / file, metadata={"format": "pt"})
    return file, described


def _write_index(directory: Path, prefix: str, parts: list[dict[str, dict[str, Any]]], world_size: int) -> str:
    """Merge every process's entries into ``<prefix>.safetensors.index.json``; return its name."""
    tensors: dict[str, dict[str, Any]] = {}
    for part in parts:
        for name, info in part.items():
            entry = tensors.setdefault(name, {"shape": info["shape"], "dtype": info["dtype"], "pieces": []})
            entry["pieces"].extend(info["pieces"])
    index: dict[str, Any] = {"metadata": {"format": "axtorch", "world_size": world_size}, "tensors": tensors}
    if all(len(e["pieces"]) == 1 and e["pieces"][0]["key"] == name for name, e in tensors.items()):
        index["weight_map"] = {name: e["pieces"][0]["file"] for name, e in sorted(tensors.items())}  # as HF
    (directory / index_file(prefix)).write_text(json.dumps(index, indent=1))
    return index_file(prefix)


def _agree(coordinator: Coordinator, what: str, action: Callable[[], T]) -> list[T]:
    """Run ``action`` on every process and gather the results; if it failed anywhere, it fails everywhere.

    Every process joins every gather, so a process whose disk is full raises like its peers
    instead of leaving them waiting in a collective it never reaches.
    """
    result: Optional[T] = None
    local_error: Optional[Exception] = None
    try:
        result = action()
    except Exception as error:
        local_error = error
    said = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
    gathered = coordinator.all_gather_object((result, said))
    failures = [(rank, message) for rank, (_, message) in enumerate(gathered) if message is not None]
    if failures:
        where = failures[0][1] if coordinator.world_size == 1 else "; ".join(f"rank {r}: {m}" for r, m in failures)
        raise CheckpointError(f"{what}: {where}") from local_error
    return [value for value, _ in gathered]


def read_index(path: Path, prefix: str = MODEL) -> dict[str, dict[str, Any]]:
    """The tensors of an index; a piece whose file lies outside ``path`` is refused, never opened."""
    tensors: dict[str, dict[str, Any]] = json.loads((path / index_file(prefix)).read_text())["tensors"]
    for name, entry in tensors.items():
        for piece in entry["pieces"]:
            if Path(piece["file"]).name != piece["file"] or piece["file"] in (".", ".."):
                raise CheckpointError(
                    f"{path / index_file(prefix)}: {name} points to {piece['file']!r}, outside the checkpoint directory"
                )
    return tensors


def checkpoint_problems(path: Path) -> list[str]:
    """What is wrong with a checkpoint (empty: it is whole): its manifest, and its indexes' file references."""
    referenced: set[str] = set()
    for prefix in (MODEL, OPTIMIZER):
        try:
            referenced |= {piece["file"] for entry in read_index(path, prefix).values() for piece in entry["pieces"]}
        except (OSError, ValueError, KeyError, TypeError, CheckpointError) as error:
            return [*verify_checkpoint(path), f"{index_file(prefix)} is unreadable ({type(error).__name__}: {error})"]
    return verify_checkpoint(path, referenced)


def newest_valid_checkpoint(root: Path) -> Optional[Path]:
    """The newest checkpoint under ``root`` that verifies, warning about each newer one that does not.

    None when there is no checkpoint at all; ``CheckpointError`` when there are some and none is whole.
    """
    rejected = []
    for path in reversed(list_checkpoints(root)):
        problems = checkpoint_problems(path)
        if not problems:
            return path
        rejected.append(f"{path.name}: {'; '.join(problems[:3])}")
        warnings.warn(
            f"checkpoint {path} failed verification ({'; '.join(problems[:3])}); trying an earlier one",
            RuntimeWarning,
            stacklevel=2,
        )
    if rejected:
        raise CheckpointError(
            f"no valid checkpoint in {root}: "
            + " | ".join(rejected)
            + ". Move the damaged ones aside (or use a new run_dir) to start over"
        )
    return None


def read_model_tensors(path: Path, prefix: str = MODEL) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole, whatever mesh wrote it (for single-process readers)."""
    return {
        name: read_block(path, entry, name, tuple(entry["shape"]), (0,) * len(entry["shape"]))
        for name, entry in read_index(path, prefix).items()
    }


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of ``model``: its state less the frozen parameters.

    A frozen base (``model/adapter``) is not saved with its adapters: it is what the run started
    from, and the trainer state records its digest (``axtorch.train.adapters``).
    """
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    return {name: value for name, value in model.state_dict().items() if name not in frozen}


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / TRAINER_STATE_FILE).read_text())


def load_model(path: Path, model: torch.nn.Module, whole_model: bool = True) -> None:
    """Load parameters in place into ``model``'s (possibly sharded) layout; every trained name must match.

    A part of the model (a process's pipeline stages) loads its own names and leaves the rest.
    """
    index = read_index(path, MODEL)
    state = trained_state(model)
    missing = sorted(set(state) - set(index))
    unexpected = sorted(set(index) - set(state)) if whole_model else []
    reshaped = [
        f"{name} {tuple(index[name]['shape'])} vs {tuple(target.shape)}"
        for name, target in state.items()
        if name in index and tuple(index[name]["shape"]) != tuple(target.shape)
    ]
    if missing or unexpected or reshaped:
        raise CheckpointError(
            f"checkpoint {path} does not fit the model: {len(missing)} missing {missing[:5]}, "
            f"{len(unexpected)} unexpected {unexpected[:5]}, {len(reshaped)} of another shape "
            f"(checkpoint vs model) {reshaped[:5]}"
        )
    for name, target in state.items():
        load_into(target, path, index[name], name)


def load_optimizer(path: Path, optimizer: torch.optim.Optimizer, whole_model: bool = True) -> None:
    """Recreate each parameter's optimizer state in the parameter's own layout, then fill it."""
    index = read_index(path, OPTIMIZER)
    keys: dict[str, list[str]] = {}
    for flat_name in index:
        name, key = flat_name.rsplit("/", 1)
        keys.setdefault(name, []).append(key)
    for group in optimizer.param_groups:
        for name, param in zip(group["names"], group["params"]):
            state = {}
            for key in keys.pop(name, []):
                entry = index[f"{name}/{key}"]
                if entry["shape"]:  # moments: same layout as the parameter
                    state[key] = torch.zeros_like(param)
                else:  # scalars such as the step count, which fused AdamW keeps on the parameter's device
                    on_device = group.get("fused") or group.get("capturable")
                    device = param.device if on_device else torch.device("cpu")
                    state[key] = torch.zeros((), dtype=getattr(torch, entry["dtype"]), device=device)
                load_into(state[key], path, entry, f"{name}/{key}")
            if state:
                optimizer.state[param] = state
    if keys and whole_model:
        raise KeyError(f"optimizer state for parameters the model lacks: {sorted(keys)[:5]}")


class Checkpointer:
    """Saves, verifies, prunes and finds checkpoints under one directory.

    With ``async_save`` the training thread pays only for copying its tensors to host memory
    (pinned, from CUDA); a background thread writes, seals and publishes them, coordinating with
    the other processes over a side channel so the training's collectives go on meanwhile. A new
    save first waits for the one in flight, and ``wait`` (which the trainer calls before it
    returns) re-raises a background failure. The thread is not a daemon: the interpreter does not
    exit with a save half written.

    A save that fails on any process (a full disk, a permission error) fails on all of them,
    removes its partial directory and leaves every earlier checkpoint as it was; the error
    reaches the caller as a ``CheckpointError``.

    Retention keeps the newest ``keep`` checkpoints, plus every one whose step is a multiple of
    ``keep_every`` (when set); pruning runs only after a save succeeded, so the newest valid
    checkpoint is never deleted.
    """

    def __init__(
        self,
        root: Path,
        keep: int,
        async_save: bool = False,
        collective: Optional[Collective] = None,
        keep_every: Optional[int] = None,
    ):
        self.root = root
        self.keep = keep
        self.keep_every = keep_every
        self.collective = collective or LocalCollective()
        self.async_save = async_save
        # The writer's own coordinator: a background thread must not share the training's group.
        several = async_save and self.collective.world_size > 1
        self._writer: Coordinator = self.collective.side_channel() if several else self.collective
        self._pending: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._failed_path = root

    def latest_valid(self) -> Optional[Path]:
        """The newest checkpoint that verifies, as the first process finds it; every process agrees."""
        found: Optional[Path] = None
        failure: Optional[str] = None
        if self.collective.rank == 0:
            try:
                found = newest_valid_checkpoint(self.root)
            except CheckpointError as error:
                failure = str(error)
        found, failure = self.collective.all_gather_object((found, failure))[0]
        if failure is not None:
            raise CheckpointError(failure)
        return found

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> Path:
        self.wait()
        path = self.root / checkpoint_dir_name(step)
        pieces = {
            MODEL: _pieces(trained_state(model), self.collective),
            OPTIMIZER: _pieces(optimizer_tensors(optimizer), self.collective),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the pinned host copies are complete from here on
        if self.async_save:
            self._pending = threading.Thread(target=self._write, args=(path, pieces, state), name=f"save {path.name}")
            self._pending.start()
        else:
            self._write(path, pieces, state)
            self._raise_pending_error()
        return path

    def wait(self) -> None:
        """Block until an asynchronous save has finished; re-raise its error if it failed."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        self._raise_pending_error()

    def poll(self) -> None:
        """Re-raise the error of an asynchronous save that has already failed; never blocks.

        With several processes it does nothing: each would see its writer end at a different
        step, and one stopping while the others train on would hang them. Their common error
        surfaces at the next ``save`` or ``wait``, which every process reaches at the same step.
        """
        if self.collective.world_size == 1 and self._pending is not None and not self._pending.is_alive():
            self.wait()

    @contextlib.contextmanager
    def saves_finish_on_error(self) -> Iterator[None]:
        """On an error, let a save in flight finish (it holds a good state) before the error propagates."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(CheckpointError):
                self.wait()
            raise

    def load(
        self,
        path: Path,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        whole_model: bool = True,
    ) -> None:
        """Restore parameters (and optimizer state) in place; trainer state is read separately.

        ``whole_model=False``: ``model`` is a part (pipeline stages) and takes only its own tensors.
        """
        try:
            load_model(path, model, whole_model)
            if optimizer is not None:
                load_optimizer(path, optimizer, whole_model)
        except (OSError, SafetensorError) as error:
            raise CheckpointError(f"reading checkpoint {path} failed: {type(error).__name__}: {error}") from error

    def _write(self, path: Path, pieces: dict[str, dict[str, list[Piece]]], state: dict[str, Any]) -> None:
        """Write into a hidden directory, seal every file, then publish it with one rename."""
        writer = self._writer
        rank, world_size = writer.rank, writer.world_size
        tmp = path.with_name(f".{path.name}.tmp")

        def prepare() -> None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)

        def write_own() -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, dict[str, Any]]]:
            described, files = {}, []
            for prefix, prefix_pieces in pieces.items():
                file, described[prefix] = _write_own_pieces(tmp, prefix, prefix_pieces, rank, world_size)
                files.append(file)
            return described, seal_files(tmp, files)

        def publish(written: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
            if rank != 0:
                return
            records = {name: record for _, part in written for name, record in part.items()}
            shared = [_write_index(tmp, prefix, [d[prefix] for d, _ in written], world_size) for prefix in pieces]
            (tmp / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2))
            records |= seal_files(tmp, [*shared, TRAINER_STATE_FILE])
            write_manifest(tmp, records)
            if path.exists():  # a re-save of the same step (e.g. the final step after a resume)
                shutil.rmtree(path)
            os.replace(tmp, path)
            fsync_directory(self.root)
            self._prune()

        try:
            _agree(writer, "preparing the directory", prepare)
            written = _agree(writer, "writing tensors", write_own)
            _agree(writer, "publishing the checkpoint", lambda: publish(written))
        except BaseException as error:  # surfaced by wait() on the training thread
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            self._error = error
            self._failed_path = path

    def _prune(self) -> None:
        for old in list_checkpoints(self.root)[: -self.keep]:
            step = int(old.name.removeprefix("step_"))
            if self.keep_every and step % self.keep_every == 0:
                continue
            shutil.rmtree(old, ignore_errors=True)

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            said = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
            raise CheckpointError(
                f"writing checkpoint {self._failed_path.name} failed ({said}); earlier checkpoints are intact"
            ) from error
