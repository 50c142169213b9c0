"""The top-level experiment schema that Hydra composes ``conf/`` into."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from axtorch.data.config import DataConfig
from axtorch.models.causal_lm import CausalLMConfig
from axtorch.parallel.mesh import MeshConfig
from axtorch.parallel.rules import ShardingConfig
from axtorch.train.config import TrainerConfig
from axtorch.train.loss import CrossEntropyLossConfig
from axtorch.train.optimizer import OptimConfig


class Backend(enum.Enum):
    #: One device (CPU or one CUDA GPU), no sharding.
    single = "single"
    #: torch.distributed under torchrun: FSDP2 and DTensor tensor parallelism over the mesh.
    native = "native"
    #: torch_xla SPMD: TPU, torch-neuronx, or CPU virtual devices.
    xla = "xla"


@dataclass
class TrainConfig:
    #: Experiment name; the default run directory is derived from it.
    name: str = "default"
    #: Where the run writes config, metrics, checkpoints and plots; resumes from what it finds there.
    run_dir: str = "runs/${name}"
    backend: Backend = Backend.single
    mesh: MeshConfig = field(default_factory=MeshConfig)
    #: How parameters and activations are split over the mesh (a ``conf/sharding/`` preset).
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    model: CausalLMConfig = field(default_factory=CausalLMConfig)
    loss: CrossEntropyLossConfig = field(default_factory=CrossEntropyLossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    #: Start from imported weights: ``hf:<directory>`` or ``gguf:<file>`` (ignored when resuming).
    init_from: Optional[str] = None
