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
    if config.backend is Backend.single:
        config.mesh.resolve(1, "mesh")  # distributed backends check the mesh against their world size
