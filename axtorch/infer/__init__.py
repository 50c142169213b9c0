"""Inference: token sampling, KV-cache generation, and CPU weight formats for decoding.

``generate`` here is the function (``from axtorch.infer import generate``); the module that
defines it stays importable by its full name (``from axtorch.infer.generate import decode_tokens``).
"""

from axtorch.infer.cpu_weights import pack_linears, packed_linears, quantize_int8
from axtorch.infer.generate import Generation, TokenChunk, decode_tokens, generate_ids
from axtorch.infer.generate import generate as generate  # binds the function over the submodule's name
from axtorch.infer.sampling import SamplingConfig

__all__ = [
    "Generation",
    "SamplingConfig",
    "TokenChunk",
    "decode_tokens",
    "generate",
    "generate_ids",
    "pack_linears",
    "packed_linears",
    "quantize_int8",
]
