"""Grouped-query heads reach SDPA whole only where its kernel for them is O(S) in memory."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from axtorch.layers import attention_kernel
from axtorch.layers.attention_kernel import SdpaKernel


def _heads_given_to_sdpa(monkeypatch, device: str, dtype: torch.dtype, with_mask: bool) -> tuple[int, bool]:
    """(k's heads, enable_gqa) as SdpaKernel calls SDPA with 8 query heads over 2 kv heads."""
    seen = {}

    def recording(q, k, v, **kwargs):
        seen.update(heads=k.shape[1], enable_gqa=kwargs["enable_gqa"])
        return torch.empty_like(q)

    monkeypatch.setattr(attention_kernel.F, "scaled_dot_product_attention", recording)
    with FakeTensorMode():  # CUDA tensors without a GPU: shapes, dtypes and devices only
        q = torch.empty(1, 8, 16, 4, device=device, dtype=dtype)
        k, v = (torch.empty(1, 2, 16, 4, device=device, dtype=dtype) for _ in range(2))
        mask = torch.ones(1, 1, 16, 16, dtype=torch.bool, device=device) if with_mask else None
        SdpaKernel()(q, k, v, mask=mask, causal=not with_mask, scale=None, dropout_p=0.0)
    return seen["heads"], seen["enable_gqa"]


@pytest.mark.parametrize(
    ("device", "dtype", "with_mask", "expected"),
    [
        ("cuda", torch.bfloat16, False, (2, True)),  # flash attention takes grouped heads
        ("cuda", torch.float32, False, (8, False)),  # no flash in fp32: repeated for the efficient kernel
        ("cuda", torch.bfloat16, True, (8, False)),  # no flash with a document mask
        ("cpu", torch.float32, True, (2, True)),  # the CPU's flash kernel takes all three
    ],
)
def test_grouped_heads_are_repeated_only_where_cuda_would_fall_back_to_the_math_kernel(
    monkeypatch, device, dtype, with_mask, expected
):
    assert _heads_given_to_sdpa(monkeypatch, device, dtype, with_mask) == expected


def test_repeating_the_heads_computes_what_sdpa_computes_with_grouped_heads():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, 4, generator=generator)
    k, v = (torch.randn(2, 2, 16, 4, generator=generator) for _ in range(2))
    mask = torch.rand(2, 1, 16, 16, generator=generator) > 0.3
    mask |= torch.eye(16, dtype=torch.bool)  # every query attends somewhere
    grouped = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    k_whole, v_whole = attention_kernel.repeated_heads(k, v, 8)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k_whole, v_whole, attn_mask=mask), grouped)
