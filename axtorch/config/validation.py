"""Cross-field checks that no single config can make alone; run before anything is built."""

from __future__ import annotations

from axtorch.config.errors import ConfigError
from axtorch.config.schema import Backend, TrainConfig


def validate_train_config(config: TrainConfig) -> None:
    """Raise ``ConfigError`` for the first impossible setting, naming its key."""
    config.model.validate("model")
    config.loss.validate("loss")
    config.optim.validate("optim")
    config.trainer.validate("trainer")
    if config.data.seq_len > config.model.max_seq_len:
        raise ConfigError(
            "data.seq_len", config.data.seq_len, f"at most model.max_seq_len={config.model.max_seq_len}",
            reason="sequences longer than the model's positions allow",
        )
    tensor_parallel = config.mesh.model
    kv_heads = config.model.decoder.layer.attention.resolved_kv_heads()
    if tensor_parallel > 1 and kv_heads % tensor_parallel:
        raise ConfigError(
            "mesh.model", tensor_parallel, f"a divisor of the {kv_heads} key/value heads",
            reason="tensor parallelism splits attention by whole key/value heads",
        )
    position = config.model.decoder.layer.attention.position
    if tensor_parallel > 1 and config.backend is Backend.native and position.varies_across_heads():
        # Native tensor parallelism runs attention on each rank's local heads without telling it
        # which; XLA's SPMD keeps global shapes in the model code, so it has no such limit.
        raise ConfigError(
            "mesh.model", tensor_parallel, f"1 with {type(position).__name__} on the native backend (or backend=xla)",
            reason=f"{type(position).__name__} treats each attention head differently, and native tensor "
            "parallelism gives each rank a subset of heads it cannot identify",
        )
    if config.model.decoder.scan_layers and config.backend is not Backend.xla:
        raise ConfigError(
            "model.decoder.scan_layers", True, "false unless backend=xla",
            reason=f"backend={config.backend.value} has no compiled loop over layers (torch_xla's scan_layers)",
        )
    if config.backend is Backend.single:
        config.mesh.resolve(1, "mesh")  # distributed backends check the mesh against their world size
