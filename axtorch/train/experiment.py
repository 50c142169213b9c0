"""The experiment: everything one training run is made of, and the checks that span its parts.

``ExperimentConfig`` is the trainer's whole input (as AXLearn's trainer config is): the model,
data, optimizer and trainer settings, and the backend and mesh that run them. Hydra composes
``conf/`` into it (``axtorch.compose``); code can also build it directly.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Optional

from axtorch.config.errors import ConfigError
from axtorch.data.config import DataConfig
from axtorch.layers.transformer import TransformerLayerConfig
from axtorch.models.causal_lm import CausalLMConfig
from axtorch.parallel.backend_kind import BackendKind
from axtorch.parallel.execution import ExecutionConfig, LayerRunnerKind
from axtorch.parallel.mesh import MESH_AXES, MeshConfig
from axtorch.parallel.mesh_rules import MeshRulesConfig
from axtorch.parallel.pipeline_config import PipelineConfig
from axtorch.parallel.sharding import ShardingConfig
from axtorch.parallel.xla_hosts import XlaHosts, expected_host_count
from axtorch.train.config import TrainerConfig
from axtorch.train.loss import CrossEntropyLossConfig
from axtorch.train.optimizer import OptimConfig


@dataclass
class ExperimentConfig:
    #: Experiment name; the default run directory is derived from it.
    name: str = "default"
    #: Where the run writes config, metrics, checkpoints and plots; resumes from what it finds there.
    run_dir: str = "runs/${name}"
    backend: BackendKind = BackendKind.single
    mesh: MeshConfig = field(default_factory=MeshConfig)
    #: Overrides chosen by the detected hardware (a ``conf/mesh_rules/`` preset; ``none`` by default).
    mesh_rules: MeshRulesConfig = field(default_factory=MeshRulesConfig)
    #: How parameters and activations are split over the mesh (a ``conf/sharding/`` preset).
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    #: Stages and micro-batches when ``mesh.pipe > 1``.
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    #: How the backend runs the model (``execution.layer_runner``), apart from how it splits it.
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    model: CausalLMConfig = field(default_factory=CausalLMConfig)
    loss: CrossEntropyLossConfig = field(default_factory=CrossEntropyLossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    #: Start from imported weights: ``hf:<directory>`` or ``gguf:<file>`` (ignored when resuming).
    init_from: Optional[str] = None

    def __post_init__(self) -> None:
        self._apply_deprecated_settings()

    def _apply_deprecated_settings(self) -> None:
        """Settings under their old keys apply to their new ones, with a warning naming the new key."""
        if self.model.decoder.scan_layers:
            warnings.warn(
                "model.decoder.scan_layers is deprecated and will be removed in the next release: "
                "use execution.layer_runner=scan",
                FutureWarning,
                stacklevel=2,
            )
            self.execution.layer_runner = LayerRunnerKind.scan

    def validate(self) -> None:
        """Raise ``ConfigError`` for the first impossible setting, naming its key."""
        self.model.validate("model")
        self.loss.validate("loss")
        self.optim.validate("optim")
        self.trainer.validate("trainer")
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                "data.seq_len",
                self.data.seq_len,
                f"at most model.max_seq_len={self.model.max_seq_len}",
                reason="sequences longer than the model's positions allow",
            )
        self._validate_parallelism()

    def _validate_parallelism(self) -> None:
        self.validate_layers_against_mesh()
        # Native context parallelism gives each process two of 2 x mesh.seq chunks, balancing
        # causal attention's work; XLA splits the sequence dimension evenly.
        chunks = self.mesh.seq * (2 if self.backend is BackendKind.native else 1)
        if self.mesh.seq > 1 and self.data.seq_len % chunks:
            raise ConfigError(
                "data.seq_len",
                self.data.seq_len,
                f"a multiple of {chunks} with mesh.seq={self.mesh.seq} and backend={self.backend.value}",
                reason=f"context parallelism cuts each sequence into {chunks} equal chunks",
            )
        if self.mesh.pipe > 1:
            self.validate_pipeline_limits()
            self._validate_pipeline_rows()
        if self.model.float8 is not None:
            self._validate_float8(self.model.float8.recipe)
        frozen_base = self.model.frozen_base
        if frozen_base is not None and self.backend is not BackendKind.single:
            raise ConfigError(
                "backend",
                self.backend.value,
                f"single with model.frozen_base={frozen_base.format}",
                reason="the int8 base is quantised after loading, where FSDP and XLA shard float parameters; "
                "its buffers would be neither sharded nor placed by the sharding rules",
            )
        if self.execution.layer_runner is LayerRunnerKind.scan and self.backend is not BackendKind.xla:
            raise ConfigError(
                "execution.layer_runner",
                "scan",
                "unrolled unless backend=xla",
                reason=f"backend={self.backend.value} has no compiled loop over layers (torch_xla's scan)",
            )
        if (
            self.backend is BackendKind.xla
            and self.execution.layer_runner is LayerRunnerKind.unrolled
            and self.model.decoder.remat is not None
            and self.model.decoder.remat.uses_policy_contexts
        ):
            raise ConfigError(
                "model/remat",
                type(self.model.decoder.remat).__name__,
                "full or none with backend=xla (or execution.layer_runner=scan, whose remat is a min-cut)",
                reason="torch's selective checkpointing finds torch_xla's aten.detach_copy in the backward but "
                "not in what it saved, and stops",
            )
        if self.trainer.compile and self.backend is BackendKind.xla:
            raise ConfigError(
                "trainer.compile",
                True,
                "false or null with backend=xla",
                reason="torch_xla traces and compiles the whole step itself; torch.compile is the native backends'",
            )
        if self.backend is BackendKind.single:
            self.mesh.resolve(1, "mesh")  # distributed backends check the mesh against their world size
        if self.backend is BackendKind.xla and (hosts := expected_host_count()):
            # Where the environment already names the hosts; the backend checks again with the runtime's.
            XlaHosts(0, hosts).check_feedable({axis: getattr(self.mesh, axis) for axis in MESH_AXES})

    def validate_layers_against_mesh(self) -> None:
        """Each of the decoder's layer configs against the mesh (whole heads per model rank, ...).

        Also run by the planner and the dry run, which set the mesh of the cluster they plan for
        (``axtorch.plan.inputs``), not the one device of the machine they run on."""
        for layer in self.model.decoder.keyed_layer_configs("model.decoder").values():
            self._validate_layer_parallelism(layer)

    def _validate_layer_parallelism(self, layer: TransformerLayerConfig) -> None:
        """The mesh against one of the decoder's layer configs (each variant of a stack has its own)."""
        tensor_parallel = self.mesh.model
        attention = layer.attention
        kv_heads = attention.resolved_kv_heads()
        if tensor_parallel > 1 and kv_heads % tensor_parallel:
            raise ConfigError(
                "mesh.model",
                tensor_parallel,
                f"a divisor of the {kv_heads} key/value heads",
                reason="tensor parallelism splits attention by whole key/value heads",
            )
        position = attention.position
        if tensor_parallel > 1 and self.backend is BackendKind.native and position.varies_across_heads():
            # Native tensor parallelism runs attention on each rank's local heads without telling it
            # which; XLA's SPMD keeps global shapes in the model code, so it has no such limit.
            raise ConfigError(
                "mesh.model",
                tensor_parallel,
                f"1 with {type(position).__name__} on the native backend (or backend=xla)",
                reason=f"{type(position).__name__} treats each attention head differently, and native tensor "
                "parallelism gives each rank a subset of heads it cannot identify",
            )
        feed_forward = layer.feed_forward
        if self.mesh.seq > 1 and self.backend is BackendKind.native and feed_forward.mixes_tokens:
            raise ConfigError(
                "mesh.seq",
                self.mesh.seq,
                f"1 for a {type(feed_forward).__name__} feed-forward with backend=native (or backend=xla)",
                reason="native context parallelism would run it on a slice of each sequence, and its "
                "tokens' outputs depend on each other (e.g. a router's capacity or load-balancing loss)",
            )

    def _validate_float8(self, recipe: str) -> None:
        if self.backend is BackendKind.xla:
            raise ConfigError(
                "model.float8",
                recipe,
                "none with backend=xla",
                reason="torchao's float8 linears call torch._scaled_mm, which torch_xla does not lower",
            )
        if self.mesh.model > 1:
            raise ConfigError(
                "mesh.model",
                self.mesh.model,
                "1 with model.float8",
                reason="tensor-parallel float8 linears need torchao's float8 parallel styles, which axtorch "
                "does not apply; float8 composes with FSDP and pipeline stages",
            )

    def validate_pipeline_limits(self) -> None:
        """What stages over ``mesh.pipe`` cannot run with, apart from the batch (``_validate_pipeline_rows``)."""
        pipe = self.mesh.pipe
        layers = self.model.decoder.keyed_layer_configs("model.decoder").items()
        feed_forward_key, feed_forward = next(
            ((f"{key}.feed_forward", layer.feed_forward) for key, layer in layers if layer.feed_forward.mixes_tokens),
            ("model.decoder.layer.feed_forward", self.model.decoder.layer.feed_forward),
        )
        limits = [
            (self.backend is BackendKind.native, "backend", self.backend.value, "native", "only torchrun runs stages"),
            (
                self.trainer.grad_accum_steps == 1,
                "trainer.grad_accum_steps",
                self.trainer.grad_accum_steps,
                "1",
                "the pipeline's micro-batches accumulate the gradients (pipeline.microbatches)",
            ),
            (self.mesh.seq == 1, "mesh.seq", self.mesh.seq, "1", "context parallelism inside stages is not built"),
            (
                not self.model.tie_embeddings,
                "model.tie_embeddings",
                True,
                "false",
                "the first and the last stage would share the embedding table",
            ),
            (
                not feed_forward.mixes_tokens,
                feed_forward_key,
                type(feed_forward).__name__,
                "a dense feed-forward",
                "auxiliary losses (a mixture of experts') do not cross stages yet",
            ),
        ]
        for fine, key, value, allowed, reason in limits:
            if not fine:
                raise ConfigError(key, value, f"{allowed} with mesh.pipe={pipe}", reason=reason)

    def _validate_pipeline_rows(self) -> None:
        pipe = self.mesh.pipe
        replicas = [getattr(self.mesh, axis) for axis in ("data", "fsdp", "expert")]
        if -1 not in replicas:  # otherwise the replica count is known only with the world size
            rows = self.trainer.batch_size // math.prod(replicas)
            self.pipeline.validate(pipe, self.model.decoder.num_layers, rows)
