"""Float32 weights as a quantized GGUF file's loaders give them: a matrix quantized to one of
GGUF's block formats and expanded back by gguf's own code (random blocks for the K-formats, which
gguf cannot quantize; they hold every code, scale and minimum those formats allow)."""

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

#: Where each K-format's float16 scales sit in its block: (offset, count).
K_SCALES = {"Q4_K": (0, 2), "Q6_K": (208, 1)}


def expanded(weight: torch.Tensor, kind: str, seed: int = 0) -> torch.Tensor:
    """``weight`` [rows, cols] quantized to the GGUF format ``kind`` and expanded back to float32
    (for a K-format, random blocks of its shape instead of ``weight``'s values)."""
    qtype = GGMLQuantizationType[kind]
    rows, cols = weight.shape
    if kind in K_SCALES:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rng = np.random.default_rng(seed)
        blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
        offset, count = K_SCALES[kind]
        scales = rng.uniform(1e-3, 1e-2, size=(blocks.shape[0], count)).astype(np.float16)
        blocks[:, offset : offset + 2 * count] = scales.view(np.uint8)
        data = blocks
    else:
        data = gguf.quants.quantize(weight.detach().numpy(), qtype)
    values = gguf.quants.dequantize(data, qtype).astype(np.float32)
    return torch.from_numpy(values).reshape(rows, cols)
