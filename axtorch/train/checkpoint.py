"""Checkpoints: safetensors for tensors, JSON for trainer state, atomic directories, optional async.

Layout of ``<run_dir>/checkpoints/step_<8-digit step>/``::

    model.safetensors               parameters by fully qualified name
    model.safetensors.index.json    HF-style weight map (name -> file), so readers never guess
    optimizer.safetensors           "<param name>/<state key>" -> tensor (e.g. ".../exp_avg")
    trainer_state.json              step, data position, RNG states, config hashes

A checkpoint is written into a temporary directory and renamed into place, so a crash never leaves
a half-written ``step_*`` directory; readers only ever see complete checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

MODEL_FILE = "model.safetensors"
MODEL_INDEX_FILE = "model.safetensors.index.json"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Flatten optimizer state to ``"<param name>/<key>"`` tensors using the groups' ``names``."""
    tensors = {}
    for group in optimizer.param_groups:
        for name, param in zip(group["names"], group["params"]):
            for key, value in optimizer.state.get(param, {}).items():
                tensors[f"{name}/{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return tensors


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of ``optimizer_tensors``: every parameter's state must be present."""
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for flat_name, value in tensors.items():
        name, key = flat_name.rsplit("/", 1)
        by_param.setdefault(name, {})[key] = value
    state_dict = optimizer.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    index = 0
    for group in optimizer.param_groups:
        for name in group["names"]:
            if name in by_param:
                state[index] = by_param.pop(name)
            index += 1
    if by_param:
        raise KeyError(f"optimizer state for unknown parameters: {sorted(by_param)[:5]}")
    state_dict["state"] = state
    optimizer.load_state_dict(state_dict)


def _cpu_snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Copies are taken before an async write so that training may keep updating the originals.
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def write_checkpoint(
    path: Path, model_tensors: dict[str, torch.Tensor], optimizer_tensors_: dict[str, torch.Tensor], state: dict[str, Any]
) -> None:
    """Write one complete checkpoint directory atomically."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(model_tensors, tmp / MODEL_FILE, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in model_tensors.values())},
        "weight_map": {name: MODEL_FILE for name in sorted(model_tensors)},
    }
    (tmp / MODEL_INDEX_FILE).write_text(json.dumps(index, indent=2))
    save_file(optimizer_tensors_, tmp / OPTIMIZER_FILE)
    (tmp / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2))
    if path.exists():  # a re-save of the same step (e.g. the final step after a resume)
        shutil.rmtree(path)
    os.replace(tmp, path)


def read_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All parameters of a checkpoint, following its index across however many files it names."""
    index = json.loads((path / MODEL_INDEX_FILE).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(path / file))
    return tensors


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / TRAINER_STATE_FILE).read_text())


class Checkpointer:
    """Saves, prunes and finds checkpoints under one directory; saves may run in a thread."""

    def __init__(self, root: Path, keep: int, async_save: bool = False):
        self.root = root
        self.keep = keep
        self.async_save = async_save
        self._pending: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def latest(self) -> Optional[Path]:
        checkpoints = list_checkpoints(self.root)
        return checkpoints[-1] if checkpoints else None

    def save(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> Path:
        self.wait()
        path = self.root / checkpoint_dir_name(step)
        model_tensors = _cpu_snapshot(model.state_dict())
        optim_tensors = _cpu_snapshot(optimizer_tensors(optimizer))
        if self.async_save:
            self._pending = threading.Thread(
                target=self._write, args=(path, model_tensors, optim_tensors, state), name="axtorch-checkpoint"
            )
            self._pending.start()
        else:
            self._write(path, model_tensors, optim_tensors, state)
            self._raise_pending_error()
        return path

    def wait(self) -> None:
        """Block until an asynchronous save has finished; re-raise its error if it failed."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        self._raise_pending_error()

    def load(self, path: Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Restore parameters (and optimizer state) in place; trainer state is read separately."""
        model.load_state_dict(read_model_tensors(path), strict=True)
        if optimizer is not None:
            load_optimizer_tensors(optimizer, load_file(path / OPTIMIZER_FILE))

    def _write(self, path: Path, model_tensors, optim_tensors, state) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            write_checkpoint(path, model_tensors, optim_tensors, state)
            for old in list_checkpoints(self.root)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException as error:  # surfaced by wait() on the training thread
            self._error = error

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("writing a checkpoint failed") from error
