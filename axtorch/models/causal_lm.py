"""Decoder-only causal language model: embedding, decoder stack, output head."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, cast

import torch
import torch.nn.functional as F
from omegaconf import MISSING
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.layers.embedding import EmbeddingConfig
from axtorch.layers.init import initialize_parameters
from axtorch.layers.kv_cache import KVCache
from axtorch.layers.linear import LinearConfig
from axtorch.layers.position_embedding import PositionEmbeddingConfig
from axtorch.layers.softcap import SoftCapConfig
from axtorch.layers.transformer import DecoderConfig, DecoderInput, TransformerLayer
from axtorch.models.adapter import AdapterConfig
from axtorch.models.float8 import Float8Config
from axtorch.models.frozen_base import FrozenBaseConfig
from axtorch.models.transforms import ModelTransformConfig


@dataclass
class CausalLMConfig:
    vocab_size: int = MISSING
    dim: int = MISSING
    #: Longest sequence the model is configured for (training length and KV-cache size bound).
    max_seq_len: int = 2048
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    #: Absolute positions added to the token embeddings (GPT-2's learned table, ``max_seq_len``
    #: rows); None means positions enter only inside attention (``decoder.layer.attention.position``).
    position_embedding: Optional[PositionEmbeddingConfig] = None
    #: Dropout on the summed input embeddings (GPT-2's ``embd_pdrop``).
    embedding_dropout: float = 0.0
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    #: Reuse the embedding table as the output head.
    tie_embeddings: bool = False
    lm_head: LinearConfig = field(default_factory=LinearConfig)
    #: Soft-capping of the output logits, ``cap * tanh(logits / cap)`` (Gemma 2: 30); None: none.
    logit_softcap: Optional[SoftCapConfig] = None
    #: Float8 training of the linears (``model/float8``): a model transform (see ``transforms``).
    float8: Optional[Float8Config] = None
    #: Adapters on a frozen model (``model/adapter=lora``): a model transform (see ``transforms``).
    adapter: Optional[AdapterConfig] = None
    #: The frozen base's stored format under adapters (``model/frozen_base=int8``); None: as loaded.
    frozen_base: Optional[FrozenBaseConfig] = None

    def validate(self, key: str = "model") -> None:
        for name in ("vocab_size", "dim", "max_seq_len"):
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(f"{key}.{name}", value, "a positive integer")
        self.embedding.validate(f"{key}.embedding")
        if not 0.0 <= self.embedding_dropout < 1.0:
            raise ConfigError(f"{key}.embedding_dropout", self.embedding_dropout, "a probability in [0, 1)")
        self.decoder.validate(self.dim, f"{key}.decoder")
        if self.logit_softcap is not None:
            self.logit_softcap.validate(f"{key}.logit_softcap")
        if self.float8 is not None:
            self.float8.validate(f"{key}.float8")
        if self.adapter is not None:
            self.adapter.validate(f"{key}.adapter")
        if self.frozen_base is not None:
            self._validate_frozen_base(key, self.frozen_base.format)

    def _validate_frozen_base(self, key: str, frozen_format: str) -> None:
        if self.adapter is None:
            raise ConfigError(
                f"{key}.frozen_base",
                frozen_format,
                "none unless model.adapter is set (e.g. model/adapter=lora)",
                reason="without adapters every weight trains, and a trained weight cannot be stored in "
                f"{frozen_format}: there would be no frozen base",
            )
        if self.float8 is not None:
            raise ConfigError(
                f"{key}.float8",
                self.float8.recipe,
                f"none with model.frozen_base={frozen_format}",
                reason=f"a frozen base linear is stored either in {frozen_format} or as torchao's float8 linear",
            )

    def transforms(self) -> list[ModelTransformConfig]:
        """The transforms training applies to the built model (``axtorch.models.transforms``).

        ``build()`` itself, and so inference, leaves them out (a run's adapters reach inference
        merged into the weights: ``axtorch.train.trained_model``).
        """
        # Adapters first: float8 then converts their frozen base linears and keeps the adapters in
        # them; the frozen base's format applies to the loaded values.
        transforms = (self.adapter, self.float8, self.frozen_base)
        return [transform for transform in transforms if transform is not None]

    def build(self) -> CausalLM:
        return CausalLM(self)


@dataclass
class CausalLMInput:
    input_ids: torch.Tensor  # [B, S] int64
    #: [B, S] absolute positions; None means 0..S-1 for every row.
    positions: Optional[torch.Tensor] = None
    #: [B, S] document of each token when a row packs several (positions restart in each); None:
    #: one document per row. Attention stays within a document (``DocumentMask``).
    segment_ids: Optional[torch.Tensor] = None
    #: One cache per layer for incremental decoding (see ``CausalLM.allocate_kv_caches``).
    kv_caches: Optional[list[KVCache]] = None
    #: Called as ``head_fn(final hidden states, head weight, head bias)`` in place of the output
    #: head, for a loss fused with it (``CrossEntropyLoss.head_fn``). It runs inside this forward,
    #: where FSDP holds the head's parameters whole; its tensors come back as ``head_output``.
    head_fn: Optional[Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], tuple[torch.Tensor, ...]]] = None
    #: [B, K] indices into the sequence of the only positions the head projects; None: every one.
    #: A prefill needs each prompt's last position only, and whole [B, S, vocab] logits would be
    #: its largest tensor by far.
    head_positions: Optional[torch.Tensor] = None


@dataclass
class CausalLMOutput:
    logits: Optional[torch.Tensor]  # [B, S, vocab_size]; None when ``head_fn`` was given
    aux_loss: Optional[torch.Tensor] = None
    kv_caches: Optional[list[KVCache]] = None
    head_output: Optional[tuple[torch.Tensor, ...]] = None


# A pytree node, so that FSDP2 finds the logits to hook backward on (see TransformerLayerOutput).
torch.export.register_dataclass(CausalLMOutput)


class CausalLM(nn.Module):
    def __init__(self, config: CausalLMConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.embedding = config.embedding.build(config.vocab_size, config.dim)
        self.position_embedding = (
            None
            if config.position_embedding is None
            else config.position_embedding.build(config.max_seq_len, config.dim)
        )
        self.decoder = config.decoder.build(config.dim)
        self.lm_head = None if config.tie_embeddings else config.lm_head.build(config.dim, config.vocab_size)
        self.logit_softcap = nn.Identity() if config.logit_softcap is None else config.logit_softcap.build()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter from its layer's config, in module order (seeded => deterministic).

        Values are drawn on the host whatever the device, so a seed gives the same weights on
        every device and backend.
        """
        initialize_parameters(self)

    def allocate_kv_caches(
        self,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_write: Optional[int] = None,
    ) -> list[KVCache]:
        """One cache per layer for positions below ``max_len``.

        Given ``max_write``, the most tokens any one forward writes (the prompt, then 1), a
        sliding-window layer keeps a ring of ``window + max_write - 1`` slots rather than ``max_len``.
        """
        caches = [
            # ModuleList iterates as plain nn.Module; the decoder's layers are all TransformerLayers.
            cast(TransformerLayer, layer).attention.allocate_kv_cache(
                batch_size, max_len, dtype=dtype, device=device, max_write=max_write
            )
            for layer in self.decoder.layers
        ]
        # Every layer writes the same positions, so caches of one shape hold the same slot
        # positions: one tensor serves them all, and a mask built from it serves every such layer
        # of a decode step (``SharedValues``).
        slot_positions: dict[tuple[int, Optional[int]], torch.Tensor] = {}
        for cache in caches:
            cache.slot_positions = slot_positions.setdefault((cache.max_len, cache.window), cache.slot_positions)
        return caches

    def forward(self, inputs: CausalLMInput) -> CausalLMOutput:
        ids = inputs.input_ids
        positions = inputs.positions
        if positions is None:
            positions = default_positions(ids)
        decoded = self.decoder(
            DecoderInput(self.embed(ids, positions), positions, inputs.kv_caches, inputs.segment_ids)
        )
        final = decoded.hidden_states
        if inputs.head_positions is not None:
            final = final.gather(1, inputs.head_positions[..., None].expand(-1, -1, final.shape[-1]))
        if inputs.head_fn is not None:
            if self.config.logit_softcap is not None:
                raise ValueError(
                    f"model.logit_softcap={self.config.logit_softcap} cannot apply to a loss fused with the "
                    "output head (loss.chunk_size): the fused loss takes the head's raw logits"
                )
            head = self.embedding if self.lm_head is None else self.lm_head
            head_output = inputs.head_fn(final, head.weight, getattr(head, "bias", None))
            return CausalLMOutput(None, decoded.aux_loss, decoded.kv_caches, head_output=head_output)
        return CausalLMOutput(logits=self.project(final), aux_loss=decoded.aux_loss, kv_caches=decoded.kv_caches)

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The decoder's input: token embeddings (plus absolute position embeddings), with dropout."""
        hidden = self.embedding(ids)
        if self.position_embedding is not None:
            hidden = hidden + self.position_embedding(positions)
        return F.dropout(hidden, self.config.embedding_dropout, self.training)

    def project(self, final_hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits from the decoder's (final-normed) output: the head, or the tied embedding table, then any soft cap."""
        head = self.embedding.attend if self.lm_head is None else self.lm_head
        return self.logit_softcap(head(final_hidden_states))


def default_positions(ids: torch.Tensor) -> torch.Tensor:
    """0..S-1 for every row of [B, S] ``ids``."""
    return torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
