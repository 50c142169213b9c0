"""``init_from=hf:DIR|gguf:FILE`` with no ``model=``: the run's model is the one the file describes.

The file's own config (``pretrained_model_config``: GGUF metadata or ``config.json``, no weight
read) replaces the composed model, so that the run's ``config.yaml`` records it as an ordinary
model config: resume, golden configs, export and the planner read it as they read a preset's.
What a run may add on top leaves the weights' shapes alone: the training transforms chosen with
``model/adapter``, ``model/float8``, ``model/frozen_base`` and ``model/remat``, and ``model.*``
overrides of training-only settings (``interop.pretrained.TRAINING_ONLY_KEYS``: dropout, those
transforms' settings, ``max_seq_len`` up to the file's). Any other ``model.*`` override or
``model/<group>`` choice would change the network the weights fit, and is refused by name. A
``model=`` preset, on the command line or in the experiment, keeps the preset, which the trainer
checks against the file (``check_same_architecture``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from importlib import resources

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from axtorch.config.errors import ConfigError
from axtorch.interop.pretrained import TRAINING_ONLY_KEYS, keeps_the_weights, pretrained_model_config

#: Group choices that apply to an imported model: how it trains, not what it is.
TRAINING_GROUPS = ("model/adapter", "model/float8", "model/frozen_base", "model/remat")
#: The model config's subtrees those choices fill, carried from the composed config onto the file's.
TRAINING_SUBTREES = ("adapter", "float8", "frozen_base", "decoder.remat")


def _choice_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


@functools.cache
def default_model_choice(config_module: str, primary_config: str) -> str:
    """The ``model`` option the primary config's defaults list names (what no choice gives)."""
    primary = OmegaConf.load(str(resources.files(config_module) / f"{primary_config}.yaml"))
    for entry in primary.defaults:
        if isinstance(entry, Mapping) and "model" in entry:
            return str(entry["model"])
    raise ValueError(f"{primary_config}.yaml names no default model")


def takes_model_from_file(composed: DictConfig, overrides: Sequence[str], model_choice: str, default: str) -> bool:
    """Whether the run's model is ``init_from``'s: there is a file, and no preset was chosen for it
    (no ``model=`` on the command line, none in the experiment)."""
    chosen = model_choice != default or any(_choice_key(override) == "model" for override in overrides)
    return bool(composed.get("init_from")) and not chosen


def with_model_from_file(composed: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """``composed`` with its model replaced by ``init_from``'s, the training transforms and the
    allowed ``model.*`` overrides carried over; anything else aimed at the model is refused."""
    source = str(composed.init_from)
    for override in overrides:
        key = _choice_key(override)
        if key.startswith("model/") and key not in TRAINING_GROUPS:
            raise ConfigError(
                key,
                override.partition("=")[2],
                f"no {key} choice: the architecture is init_from's ({source}); on top of it: {list(TRAINING_GROUPS)}",
                reason="it would change the network the file's weights fit",
            )
    imported = pretrained_model_config(source)
    model = OmegaConf.structured(imported)
    for subtree in TRAINING_SUBTREES:
        OmegaConf.update(model, subtree, OmegaConf.select(composed.model, subtree), merge=False)
    for override in overrides:
        key = _choice_key(override)
        if not key.startswith("model."):
            continue
        setting = key[len("model.") :]
        if not keeps_the_weights(setting):
            raise ConfigError(
                key,
                override.partition("=")[2],
                f"a training-only setting (a key through one of {sorted(TRAINING_ONLY_KEYS)})",
                reason=f"the model is init_from's ({source}), whose weights fit its own architecture",
            )
        try:
            OmegaConf.update(model, setting, OmegaConf.select(composed.model, setting), merge=False)
        except OmegaConfBaseException as error:
            raise ConfigError(key, override.partition("=")[2], f"a key of {source}'s model config") from error
    if model.max_seq_len > imported.max_seq_len:
        raise ConfigError(
            "model.max_seq_len", model.max_seq_len, f"at most {imported.max_seq_len}, the context length of {source}"
        )
    composed.model = model
    return composed
