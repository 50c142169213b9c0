"""Inference: token sampling, KV-cache generation, and CPU weight formats for decoding.

``from axtorch.infer import generate`` is the function; ``axtorch.infer.decoding`` defines it.
"""

from axtorch.infer.cpu_weights import DecodeKernel, decode_weights, pack_linears, quantize_int8
from axtorch.infer.decoding import Generation, TokenChunk, decode_tokens, generate, generate_ids
from axtorch.infer.sampling import SamplingConfig

__all__ = [
    "DecodeKernel",
    "Generation",
    "SamplingConfig",
    "TokenChunk",
    "decode_tokens",
    "decode_weights",
    "generate",
    "generate_ids",
    "pack_linears",
    "quantize_int8",
]
