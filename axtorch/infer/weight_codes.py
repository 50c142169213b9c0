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
block exactly (and a fused multiply-add would too: the scale times the code is exact in float32, or
the offset is zero). A matrix with one block that no candidate reproduces (trained weights, a
format like Q6_K whose scales change every 16 weights) keeps its float32 weights: the choice is a
rule on the weights, and the products are the float32 ones up to summation order either way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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
#: Blocks encoded at a time: bounds the working tensors at a few tens of MB.
CHUNK_BLOCKS = 1 << 18
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


def _round_significand(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded to ``bits`` significant bits (scaling by powers of two is exact)."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2.0**bits), exponent - bits)


def _rounded(scale: torch.Tensor) -> Iterator[tuple[torch.Tensor, Optional[int]]]:
    """``scale``, then rounded to the significant bits of the formats' scales (``SCALE_BITS``)."""
    yield scale, None
    for significant in SCALE_BITS:
        yield _round_significand(scale, significant), significant


def _without_minimum(blocks: torch.Tensor, bits: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The formats without a minimum: the weight of greatest magnitude sets the scale. With 4-bit
    codes it takes code 0 and the offset is -8 scales (Q4_0: d = max / -8); with signed 8-bit codes
    it takes 127, 16 or 32 and there is no offset (Q8_0, Q5_0, Q6_K)."""
    extreme = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
    for code in (127, 16, 32) if bits == 8 else (-8,):
        for scale, _ in _rounded(extreme / code):
            yield scale, torch.zeros_like(scale) if bits == 8 else -8 * scale


def _with_minimum(blocks: torch.Tensor, bits: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The formats with a minimum: the block's least and greatest weights take codes within 3 of
    the ends (exactly 0 and the top where the format's scale is (max - min) / top, near them where
    it was searched for, as in Q4_K's, or where a block lacks the end codes)."""
    low, high = blocks.aminmax(dim=1, keepdim=True)
    tops = (15,) if bits == 4 else (15, 31)  # 16 codes (Q4_1, Q4_K) or 32 (Q5_1, Q5_K)
    near = [(a, b) for distance in range(7) for a in range(4) for b in range(4) if a + b == distance]
    ends = [(a, top - b) for top in tops for a, b in near]
    for low_code, high_code in ends:
        for scale, significant in _rounded((high - low) / (high_code - low_code)):
            offset = low - scale * low_code
            yield scale, offset
            if significant is not None and low_code:
                yield scale, _round_significand(offset, significant)


def _candidates(blocks: torch.Tensor, bits: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Scales and offsets ``[n, 1]`` to try for ``blocks`` ``[n, BLOCK]``, the likeliest formats
    for the width first."""
    if bits == 4:
        yield from _with_minimum(blocks, bits)
        yield from _without_minimum(blocks, bits)
    else:
        yield from _without_minimum(blocks, bits)
        yield from _with_minimum(blocks, bits)


def _encode_blocks(blocks: torch.Tensor, bits: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Codes ``[n, BLOCK]`` (int16) and scales ``[n, 2]`` that give ``blocks`` exactly, or None."""
    lowest, highest = CODE_RANGES[bits]
    codes = torch.zeros(blocks.shape, dtype=torch.int16)
    scales = torch.zeros(blocks.shape[0], 2)
    pending = torch.ones(blocks.shape[0], dtype=torch.bool)
    constant = blocks.amin(dim=1) == blocks.amax(dim=1)  # scale 1, code 0, the value as offset
    scales[constant, 0], scales[constant, 1] = 1.0, blocks[constant, 0]
    pending &= ~constant
    for scale, offset in _candidates(blocks, bits):
        if not pending.any():
            break
        rows = pending.nonzero().squeeze(1)
        s, o, w = scale[rows], offset[rows], blocks[rows]
        usable = torch.isfinite(s).squeeze(1) & (s != 0).squeeze(1)
        trial = torch.round((w - o) / torch.where(s == 0, 1.0, s)).clamp(lowest, highest)
        product = s * trial
        exact = (product + o == w).all(dim=1)
        fusable = (o == 0).squeeze(1) | (product.double() == s.double() * trial.double()).all(dim=1)
        found = rows[usable & exact & fusable]
        if found.numel():
            picked = usable & exact & fusable
            codes[found] = trial[picked].to(torch.int16)
            scales[found, 0], scales[found, 1] = s[picked, 0], o[picked, 0]
            pending[found] = False
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
