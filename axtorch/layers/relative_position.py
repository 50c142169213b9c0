"""Position encodings applied inside attention (RoPE, ALiBi). ``PositionConfig`` is the slot type.

Both encode where keys lie relative to the query; ``position_embedding`` is the other kind, a
learned table of absolute positions added to the token embeddings before the first layer.

An encoding acts in one or both of two places, the two methods of ``PositionEncoding``: on the
queries and keys before their dot product (RoPE rotates them), and on the scores after it (ALiBi
adds a bias). Both take absolute positions, so an encoding works unchanged with the KV cache,
where the keys are cache slots indexed by position.

Rotary embeddings come in several frequency schedules (plain, Llama 3.1, linear, YaRN). They
differ only in the inverse frequencies and in a scale on cos/sin, so each variant is a config
class that computes those two things, and all of them build the one ``RotaryEmbedding`` module
that applies the rotation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from axtorch.layers.attention_mask import position_distance
from axtorch.layers.shared_values import SharedValues


@dataclass
class PositionConfig:
    """Slot type for the position encoding of queries and keys; build with ``build(head_dim)``."""

    def build(self, head_dim: int) -> PositionEncoding:
        raise NotImplementedError(f"{type(self).__name__} is a slot type: choose a concrete position config")

    def varies_across_heads(self) -> bool:
        """True when heads are encoded differently (ALiBi's slopes).

        Such an encoding must see every head: a tensor-parallel backend that hands each rank a
        subset of heads, without saying which, cannot run it. Validation reads this.
        """
        return False

    def saved_width(self, head_dim: int) -> float:
        """Values per token its backward keeps (``axtorch.plan.memory``): none unless it says."""
        return 0.0


class PositionEncoding(nn.Module):
    """What attention asks of a position encoding; the defaults leave attention position-blind.

    ``forward`` transforms queries [B, Hq, S, D] and keys [B, Hkv, S, D] at ``positions`` [B, S]
    before their dot product; what it derives from the positions alone it may take from
    ``shared``, the other layers' (``SharedValues``: a decode step builds its tables once).
    ``score_bias`` returns a float [B, num_heads, Sq, Sk] added to the scores (after the softmax
    scale and any soft cap, together with the mask), or None for no bias; its query and key
    positions are [B, Sq] and [B, Sk], the keys being cache slots when decoding with a KV cache.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, shared: Optional[SharedValues] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def score_bias(
        self, query_positions: torch.Tensor, key_positions: torch.Tensor, num_heads: int
    ) -> Optional[torch.Tensor]:
        return None


@dataclass
class RotaryEmbeddingConfig(PositionConfig):
    """Plain RoPE: pair i of a head rotates at ``theta ** (-2i / head_dim)`` radians per position.

    Subclasses change the frequency schedule by overriding ``inverse_frequencies`` and
    ``attention_scaling``. Frequencies are computed in float32 with the same operations, in the
    same order, as HF transformers' ``rope_init_fn``s, so that the two agree bit for bit.
    """

    theta: float = 10000.0

    def build(self, head_dim: int) -> RotaryEmbedding:
        return RotaryEmbedding(self, head_dim)

    def saved_width(self, head_dim: int) -> float:
        return 2 * head_dim  # each token's cosines and sines, which the rotation's backward multiplies by

    def inverse_frequencies(self, head_dim: int, device: torch.device) -> torch.Tensor:
        """float32 [head_dim / 2] radians per position of each rotated pair."""
        return 1.0 / self._theta_powers(head_dim, device)

    def _theta_powers(self, head_dim: int, device: torch.device) -> torch.Tensor:
        """float32 [head_dim / 2] ``theta ** (2i / head_dim)``, the reciprocals of plain RoPE's frequencies."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        return self.theta**exponents

    def attention_scaling(self) -> float:
        """Factor on cos and sin (so on q.k through both): a softmax temperature for long contexts."""
        return 1.0


@dataclass
class Llama3RotaryEmbeddingConfig(RotaryEmbeddingConfig):
    """Llama 3.1 frequency remapping for long contexts.

    Pairs whose wavelength is shorter than ``original_max_position_embeddings / high_freq_factor``
    keep their frequency; those longer than ``original_max_position_embeddings / low_freq_factor``
    are slowed down ``factor`` times; the band between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inverse_frequencies(self, head_dim: int, device: torch.device) -> torch.Tensor:
        unscaled = super().inverse_frequencies(head_dim, device)
        original_length = self.original_max_position_embeddings
        wavelength = 2 * math.pi / unscaled
        # 0 at the low-frequency edge of the band, 1 at its high-frequency edge.
        smooth = (original_length / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        interpolated = (1 - smooth) * unscaled / self.factor + smooth * unscaled
        slowed = torch.where(wavelength > original_length / self.low_freq_factor, unscaled / self.factor, interpolated)
        return torch.where(wavelength < original_length / self.high_freq_factor, unscaled, slowed)


@dataclass
class LinearScaledRotaryEmbeddingConfig(RotaryEmbeddingConfig):
    """Position interpolation: positions divided by ``factor`` (computed, as HF does, on the frequencies)."""

    factor: float = 1.0

    def inverse_frequencies(self, head_dim: int, device: torch.device) -> torch.Tensor:
        return super().inverse_frequencies(head_dim, device) / self.factor


@dataclass
class YarnRotaryEmbeddingConfig(RotaryEmbeddingConfig):
    """YaRN (Peng et al. 2023): interpolate slow pairs, keep fast ones, and sharpen attention.

    Pairs that turn more than ``beta_fast`` times over ``original_max_position_embeddings`` keep
    their frequency, those that turn fewer than ``beta_slow`` times are divided by ``factor``, and a
    linear ramp over pair indices blends the two between. cos and sin are multiplied by
    ``attention_factor``, by default ``0.1 * ln(factor) + 1``.
    """

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    #: None means ``0.1 * ln(factor) + 1`` (1 when ``factor <= 1``).
    attention_factor: Optional[float] = None
    #: Round the ramp's ends outwards to whole pair indices (HF's default; gpt-oss turns it off).
    truncate: bool = True

    def inverse_frequencies(self, head_dim: int, device: torch.device) -> torch.Tensor:
        powers = self._theta_powers(head_dim, device)
        kept, interpolated = 1.0 / powers, 1.0 / (self.factor * powers)
        low, high = self._ramp_ends(head_dim)
        if low == high:
            high += 0.001  # a ramp of zero width would divide by zero
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        keep_weight = 1 - ramp
        return interpolated * (1 - keep_weight) + kept * keep_weight

    def _ramp_ends(self, head_dim: int) -> tuple[float, float]:
        """Pair indices at which the pairs turn ``beta_fast`` and ``beta_slow`` times over the original context."""

        def pair_index(turns: float) -> float:
            positions_per_radian = self.original_max_position_embeddings / (turns * 2 * math.pi)
            return (head_dim * math.log(positions_per_radian)) / (2 * math.log(self.theta))

        low, high = pair_index(self.beta_fast), pair_index(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, head_dim - 1)

    def attention_scaling(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


@dataclass
class NoPositionConfig(PositionConfig):
    def build(self, head_dim: int) -> NoPosition:
        return NoPosition()


@dataclass
class AlibiConfig(PositionConfig):
    """ALiBi (Press et al. 2022): no rotation; each head's scores fall linearly with the distance.

    Head h adds ``-slope_h * (query_pos - key_pos)`` to its scores. The slopes are fixed, a
    geometric sequence over the heads (``alibi_slopes``), so ALiBi has no parameters and no
    maximum length.
    """

    def build(self, head_dim: int) -> AlibiPositionBias:
        return AlibiPositionBias()

    def varies_across_heads(self) -> bool:
        return True


class RotaryEmbedding(PositionEncoding):
    """Rotary position embedding (RoFormer) in the "rotate half" layout that HF Llama uses.

    The frequency schedule comes from the config (any ``RotaryEmbeddingConfig``). Angles are
    computed in float32 from the absolute positions on every call: no buffers, so the module is
    valid on the meta device and for any sequence length, and the values match HF's float32
    computation bit for bit.
    """

    def __init__(self, config: RotaryEmbeddingConfig, head_dim: int):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.config = config
        self.head_dim = head_dim
        #: What the cos/sin tables depend on besides the positions: layers with equal schedules
        #: and head sizes share one table under ``SharedValues``.
        self.table_key = (type(config), dataclasses.astuple(config), head_dim)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, shared: Optional[SharedValues] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` [B, Hq, S, D] and ``k`` [B, Hkv, S, D] by ``positions`` [B, S].

        With ``shared``, layers of the same schedule and head size share one cos/sin table.
        """
        cos, sin = self.tables(positions, q.device, shared)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def tables(
        self, positions: torch.Tensor, device: torch.device, shared: Optional[SharedValues] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_sin``, computed once per forward for all layers of this schedule and head size under ``shared``."""
        if shared is None:
            return self.cos_sin(positions, device)
        return shared.get((self.table_key, id(positions)), lambda: self.cos_sin(positions, device))

    def cos_sin(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [B, 1, S, D] cos and sin of every position's angles, times the attention
        scaling, with the first half of sin negated (the sign that rotating half the features
        needs: ``_rotate``)."""
        inverse_frequencies = self.config.inverse_frequencies(self.head_dim, device)
        angles = positions.float()[..., None] * inverse_frequencies  # [B, S, D/2]
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, S, D]
        scaling = self.config.attention_scaling()
        sin = angles.sin() * scaling
        half = self.head_dim // 2
        return angles.cos() * scaling, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x cos + rotate_half(x) sin``, with ``rotate_half(x) = [-x2, x1]`` written as the halves
    swapped (one ``roll``) times the signed sin: the same values, in four ops instead of nine."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class NoPosition(PositionEncoding):
    """No position information in attention (for models that add it elsewhere, or NoPE)."""


class AlibiPositionBias(PositionEncoding):
    """Adds ``-slope_h * (query_pos - key_pos)`` to the scores of head h; leaves q and k alone.

    The bias is computed from absolute positions on every call (no buffers, like RoPE), in
    float32. Keys in a query's future get a positive bias, which the causal mask removes.
    """

    def score_bias(self, query_positions: torch.Tensor, key_positions: torch.Tensor, num_heads: int) -> torch.Tensor:
        slopes = alibi_slopes(num_heads, query_positions.device)[:, None, None]  # [H, 1, 1]
        return -slopes * position_distance(query_positions, key_positions).float()  # [B, H, Sq, Sk]


def alibi_slopes(num_heads: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """float32 [num_heads] ALiBi slopes, as the paper's code (and HF Bloom) computes them.

    For a power of two ``n`` heads: ``2 ** (-8 i / n)`` for i = 1..n, so 8 heads get 1/2 .. 1/256.
    Otherwise the ``m`` slopes of the largest power of two below, then every other slope (the
    odd i) of the sequence for ``2m`` heads, up to ``num_heads``: interpolated slopes that stay
    in the same range.
    """
    if num_heads <= 0:
        raise ValueError(f"ALiBi needs a positive number of heads, got {num_heads}")
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = _geometric_slopes(closest, device)
    if closest == num_heads:
        return slopes
    return torch.cat([slopes, _geometric_slopes(2 * closest, device)[0::2][: num_heads - closest]])


def _geometric_slopes(num_heads: int, device: Optional[torch.device]) -> torch.Tensor:
    """float32 [num_heads] ``r ** i`` for i = 1..num_heads with ``r = 2 ** (-8 / num_heads)``."""
    ratio = torch.tensor(2 ** (-8 / num_heads), dtype=torch.float32, device=device)
    return ratio ** torch.arange(1, num_heads + 1, dtype=torch.int32, device=device)
