"""Block codes (``weight_codes``): a matrix expanded from a GGUF block format is found again as
codes that give back every weight exactly, 4-bit where the format has 16 codes and 8-bit where it
has more; trained weights, one weight off, formats whose scales change inside a block, and codes
a fused multiply-add would widen differently keep the float32 weights."""

import pytest
import torch

from axtorch.infer import weight_codes
from axtorch.infer.weight_codes import BLOCK, SAMPLE_BLOCKS, codes_of, encode, stacked
from tests.gguf_blocks import expanded


def _weight(rows: int = 48, cols: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize(
    ("kind", "bits"),
    [("Q4_0", 4), ("Q4_1", 4), ("Q4_K", 4), ("Q5_0", 8), ("Q5_1", 8), ("Q8_0", 8)],
)
def test_a_matrix_expanded_from_a_block_format_is_coded_exactly(kind, bits):
    weight = expanded(_weight(), kind)
    codes = encode(weight)
    assert codes is not None and codes.bits == bits
    assert codes.codes.shape == (48, 256 * bits // 8) and codes.scales.shape == (48, 256 // BLOCK, 2)
    assert torch.equal(codes.weights(), weight)
    assert codes.nbytes == weight.nbytes * (bits + 2) // 32  # a code a weight, two floats a block


def test_rows_of_a_4_bit_and_an_8_bit_format_are_coded_in_8_bits():
    """A stacked matrix (q/k/v, gate/up) whose parts came from different formats."""
    weight = torch.cat([expanded(_weight(seed=1), "Q4_K"), expanded(_weight(seed=2), "Q8_0")])
    codes = encode(weight)
    assert codes is not None and codes.bits == 8
    assert torch.equal(codes.weights(), weight)


def test_many_blocks_are_coded_in_chunks(monkeypatch):
    monkeypatch.setattr(weight_codes, "CHUNK_BLOCKS", 7)
    weight = expanded(_weight(rows=40), "Q4_1")
    codes = encode(weight)
    assert codes is not None and torch.equal(codes.weights(), weight)


@pytest.mark.parametrize(
    "why",
    ["trained", "one weight off", "one weight off past the sample", "Q6_K", "not a multiple of 32", "bfloat16", "nan"],
)
def test_what_no_codes_give_exactly_keeps_its_float32_weights(why):
    weight = expanded(_weight(), "Q4_1")
    if why == "trained":
        weight = _weight()
    elif why.startswith("one weight off"):
        row = 0 if why == "one weight off" else (SAMPLE_BLOCKS * BLOCK) // weight.shape[1] + 3
        weight[row, 5] = torch.nextafter(weight[row, 5], torch.tensor(1.0))
    elif why == "Q6_K":  # a scale every 16 weights: two in a block of 32
        weight = expanded(_weight(), "Q6_K")
    elif why == "not a multiple of 32":
        weight = weight[:, :200]
    elif why == "bfloat16":
        weight = weight.bfloat16()
    else:
        weight[3, 3] = float("nan")
    assert encode(weight) is None


def test_codes_that_a_fused_multiply_add_would_widen_differently_are_refused():
    """scale * code rounded, then the offset added: equal to the weight, but one rounding (what a
    compiler may fuse the kernel's widening into) would give another."""
    scale, offset = torch.tensor(1.9925466775894165), 2.3046653270721436  # 24 significant bits
    codes = torch.arange(BLOCK) % 16
    weight = (scale * codes.float() + offset).repeat(4, 1)
    fused = (scale.double() * codes.double() + offset).float()
    assert not torch.equal(weight[0], fused)  # the two widenings differ on this block
    assert encode(weight) is None


def test_stacked_codes_are_the_codes_of_the_stacked_weights_in_the_widest_width():
    parts = [expanded(_weight(seed=1), "Q4_1"), expanded(_weight(seed=2), "Q8_0"), expanded(_weight(seed=3), "Q4_K")]
    codes = stacked([encode(part) for part in parts])
    assert codes is not None and codes.bits == 8
    assert torch.equal(codes.weights(), torch.cat(parts))
    four = stacked([encode(parts[0]), encode(parts[2])])
    assert four is not None and four.bits == 4 and torch.equal(four.weights(), torch.cat([parts[0], parts[2]]))
    assert stacked([encode(parts[0]), encode(_weight())]) is None  # a part without codes


def test_codes_are_found_once_per_weight_and_again_after_it_changes(monkeypatch):
    weight = expanded(_weight(), "Q4_1")
    calls = []
    monkeypatch.setattr(weight_codes, "encode", lambda w: calls.append(w) or encode(w))
    first = codes_of(weight)
    assert codes_of(weight) is first and len(calls) == 1
    weight.mul_(0.5)  # an optimizer step, a load: the version moves
    again = codes_of(weight)
    assert len(calls) == 2 and again is not None and torch.equal(again.weights(), weight)
