"""Exact block codes for float32 weights that a 4- or 8-bit format was expanded from: the same
weights, bit for bit, in a fifth (4-bit) or a third (8-bit) of the bytes a decode step reads.

Every loader of a quantized GGUF file (axtorch's ``interop.gguf``, transformers') expands its
tensors to float32, and each block of 32 weights of a row then holds a few distinct values:
``scale * code + offset`` with small integer codes (Q4_0, Q4_1, Q4_K: 16 codes; Q5_0, Q5_1, Q8_0:
32 to 256). A decode step on a CPU is bound by the bytes it reads, so axtorch's own kernel
(``kernels.h``'s ``matrix_t``) reads such a matrix as its codes and each block's scale and offset,
and widens them back to the float32 weights as it multiplies.

``encode`` finds the codes from the weights alone, so it holds whatever route the weights took
(a GGUF import, an HF directory written from one, a checkpoint): a few candidate scales and offsets
per block from its extremes, each kept only where widening its codes gives every weight of the
block exactly (and a fused multiply-add would too: the scale's significant bits and the largest
code's fit float32's 24, so their product is exact, or the offset is zero). A matrix with one
block that no candidate reproduces (trained weights, a format like Q6_K whose scales change every
16 weights) keeps its float32 weights: the choice is a rule on the weights, and the products are
the float32 ones up to summation order either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

#: Weights a block's scale and offset cover (``BLOCK`` in ``kernels.h``).
BLOCK = 32
#: The codes each width holds.
CODE_RANGES = {4: (0, 15), 8: (-128, 127)}
#: Significant bits of the scales tried besides float32's: a float16 scale (Q4_0, Q4_1, Q5_0,
#: Q8_0), and one times a 6-bit sub-scale (Q4_K, Q5_K).
SCALE_BITS = (11, 17)
#: Blocks encoded at a time, and the trial codes of a group of candidates at most (elements):
#: bounds the working tensors at a few tens of MB.
CHUNK_BLOCKS = 1 << 16
TRIAL_ELEMENTS = CHUNK_BLOCKS * BLOCK
#: Blocks tried first: a matrix of trained weights is refused on them, in a fraction of the time
#: that trying all its blocks with every candidate would take.
SAMPLE_BLOCKS = 64


@dataclass(frozen=True)
class WeightCodes:
    """A ``[rows, cols]`` float32 weight as block codes: weight = scale * code + offset, exactly."""

    #: uint8 ``[rows, cols * bits // 8]``; 4 bits: byte j of a block holds the code of weight j in
    #: its low half and of weight j + 16 in its high half; 8 bits: signed codes.
    codes: torch.Tensor
    #: float32 ``[rows, cols // BLOCK, 2]``: each block's scale and offset.
    scales: torch.Tensor
    bits: int

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def weights(self) -> torch.Tensor:
        """The float32 weight the codes stand for."""
        rows = self.codes.shape[0]
        codes = self.codes.view(torch.int8) if self.bits == 8 else _unpack_nibbles(self.codes)
        blocks = codes.reshape(rows, -1, BLOCK).float()
        return (blocks * self.scales[..., :1] + self.scales[..., 1:]).reshape(rows, -1)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    halves = packed.reshape(packed.shape[0], -1, BLOCK // 2)
    return torch.cat([halves & 15, halves >> 4], dim=-1).reshape(packed.shape[0], -1)


def _round_significand(x: torch.Tensor, bits: torch.Tensor | int) -> torch.Tensor:
    """``x`` rounded to ``bits`` significant bits (scaling by powers of two is exact; 24: ``x``)."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2.0**bits), exponent - bits)


def _specs(bits: int) -> torch.Tensor:
    """The candidate scales and offsets to try for a width, likeliest first, each a row of
    (with a minimum, code a, code b, significant bits of the scale, of the offset); 24 bits: as
    computed (float32's significand).

    With a minimum (Q4_1, Q4_K; Q5_1, Q5_K in 8 bits): the block's least and greatest weights take
    codes a and b within 3 of the ends (exactly 0 and the top where the format's scale is
    (max - min) / top, near them where it was searched for, as in Q4_K's, or where a block lacks
    the end codes). Without one: the weight of greatest magnitude takes code a; with 4-bit codes
    that is 0 and the offset is -8 scales (Q4_0: d = max / -8), with signed 8-bit codes 127, 16 or
    32 and there is no offset (Q8_0, Q5_0, Q6_K). Each scale is also tried rounded to the formats'
    significant bits (``SCALE_BITS``), with the offset as it comes and rounded alike."""
    near = [(a, b) for distance in range(7) for a in range(4) for b in range(4) if a + b == distance]
    tops = (15,) if bits == 4 else (15, 31)
    with_minimum = [
        (1, a, top - b, significant, offset_bits)
        for top in tops
        for a, b in near
        for significant, offset_bits in ((24, 24), *((s, o) for s in SCALE_BITS for o in (24, s)))
    ]
    without = [
        (0, code, code + 1, significant, 24)
        for code in ((127, 16, 32) if bits == 8 else (-8,))
        for significant in (24, *SCALE_BITS)
    ]
    rows = with_minimum + without if bits == 4 else without + with_minimum
    return torch.tensor(rows, dtype=torch.float32)


SPECS = {bits: _specs(bits) for bits in CODE_RANGES}


def _candidates(
    specs: torch.Tensor, low: torch.Tensor, high: torch.Tensor, extreme: Optional[torch.Tensor], bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and offsets ``[len(specs), n, 1]`` of ``SPECS`` rows for blocks whose least, greatest
    and greatest-magnitude weights are ``low``, ``high``, ``extreme`` ``[n, 1]`` (``extreme`` None
    where every spec has a minimum)."""
    with_minimum, a, b, significant, offset_bits = (specs[:, i, None, None] for i in range(5))
    raw = (high - low) / (b - a)
    if extreme is not None:
        raw = torch.where(with_minimum.bool(), raw, extreme / a)
    scale = _round_significand(raw, significant)
    below = _round_significand(low - scale * a, offset_bits)
    offset = torch.where(with_minimum.bool(), below, -8 * scale if bits == 4 else torch.zeros_like(scale))
    return scale, offset


def _encode_blocks(blocks: torch.Tensor, bits: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Codes ``[n, BLOCK]`` (int16) and scales ``[n, 2]`` that give ``blocks`` exactly, or None.
    The candidates are tried in groups as large as ``TRIAL_ELEMENTS`` allows for the blocks still
    pending: on a matrix's sample (``SAMPLE_BLOCKS``) all of them at once, so that trained weights
    are refused in a few operations rather than a round per candidate."""
    lowest, highest = CODE_RANGES[bits]
    codes = torch.zeros(blocks.shape, dtype=torch.int16)
    scales = torch.zeros(blocks.shape[0], 2)
    pending = torch.ones(blocks.shape[0], dtype=torch.bool)
    low, high = blocks.aminmax(dim=1, keepdim=True)
    constant = (low == high).squeeze(1)  # scale 1, code 0, the value as offset
    scales[constant, 0], scales[constant, 1] = 1.0, blocks[constant, 0]
    pending &= ~constant
    extreme: Optional[torch.Tensor] = None  # the greatest-magnitude weights, once a candidate needs them
    specs, tried = SPECS[bits], 0
    while pending.any() and tried < len(specs):
        rows = pending.nonzero().squeeze(1)
        group = specs[tried : tried + max(1, TRIAL_ELEMENTS // (rows.numel() * BLOCK))]
        tried += len(group)
        if extreme is None and not group[:, 0].all():
            extreme = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
        if rows.numel() == len(blocks):  # the first group sees every block: no copies of them
            w, least, greatest, farthest = blocks, low, high, extreme
        else:
            w, least, greatest = blocks[rows], low[rows], high[rows]
            farthest = None if extreme is None else extreme[rows]
        s, o = _candidates(group, least, greatest, farthest, bits)  # [candidates, rows, 1]
        usable = torch.isfinite(s) & (s != 0)
        trial = torch.round((w - o) / torch.where(usable, s, 1.0)).clamp(lowest, highest)
        product = s * trial
        exact = (product + o == w).all(dim=-1) & usable.squeeze(-1)
        # Fusable if the scale's products with the block's codes are exact: they are where the
        # scale's significant bits and the largest code's fit float32's 24.
        _, code_bits = torch.frexp(trial.abs().amax(dim=-1, keepdim=True))
        fusable = ((o == 0) | (_round_significand(s, 24 - code_bits) == s)).squeeze(-1)
        good = exact & fusable
        found = good.any(dim=0)
        if found.any():
            which, first = found.nonzero().squeeze(1), good.int().argmax(dim=0)[found]
            codes[rows[which]] = trial[first, which].to(torch.int16)
            scales[rows[which], 0], scales[rows[which], 1] = s[first, which, 0], o[first, which, 0]
            pending[rows[which]] = False
    return None if pending.any() else (codes, scales)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes.to(torch.int8).view(torch.uint8)
    nibbles = codes.to(torch.uint8)
    return nibbles[:, : BLOCK // 2] | (nibbles[:, BLOCK // 2 :] << 4)


def _encode_as(weight: torch.Tensor, bits: int) -> Optional[WeightCodes]:
    rows = weight.shape[0]
    blocks = weight.reshape(-1, BLOCK)
    if _encode_blocks(blocks[:SAMPLE_BLOCKS], bits) is None:
        return None
    packed, scales = [], []
    for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
        found = _encode_blocks(blocks[start : start + CHUNK_BLOCKS], bits)
        if found is None:
            return None
        packed.append(_pack(found[0], bits))
        scales.append(found[1])
    return WeightCodes(torch.cat(packed).reshape(rows, -1), torch.cat(scales).reshape(rows, -1, 2), bits)


@torch.no_grad()
def encode(weight: torch.Tensor) -> Optional[WeightCodes]:
    """``weight`` (float32 ``[rows, cols]``, ``cols`` a multiple of ``BLOCK``) as 4-bit codes where
    every block has them, else 8-bit ones, else None."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or weight.device.type != "cpu":
        return None
    weight = weight.detach().contiguous()
    return _encode_as(weight, 4) or _encode_as(weight, 8)


#: ``codes_of``'s findings: a weight -> (its address and version when found, its codes or None).
_FOUND = WeakIdKeyDictionary()


def codes_of(weight: torch.Tensor) -> Optional[WeightCodes]:
    """``encode(weight)``, found once while ``weight`` is the same tensor, unmodified (an optimizer
    step or a load bumps its version): finding them reads the weights several times over."""
    stamp = (weight.data_ptr(), weight._version)
    found = _FOUND.get(weight)
    if found is None or found[0] != stamp:
        found = (stamp, encode(weight))
        _FOUND[weight] = found
    return found[1]


def _as_8_bit(codes: WeightCodes) -> WeightCodes:
    if codes.bits == 8:
        return codes
    wide = _unpack_nibbles(codes.codes).to(torch.int8).view(torch.uint8)
    return WeightCodes(wide, codes.scales, 8)


def stacked(parts: Sequence[Optional[WeightCodes]]) -> Optional[WeightCodes]:
    """The codes of the parts' rows stacked (as ``torch.cat`` stacks their weights: q/k/v, gate/up),
    in 8 bits if any part's are; None if a part has none."""
    if any(part is None for part in parts):
        return None
    present = [part for part in parts if part is not None]
    if len({part.bits for part in present}) > 1:
        present = [_as_8_bit(part) for part in present]
    return WeightCodes(torch.cat([p.codes for p in present]), torch.cat([p.scales for p in present]), present[0].bits)
