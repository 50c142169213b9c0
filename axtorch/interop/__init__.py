"""Conversion between axtorch models and other ecosystems' checkpoints (HF transformers, llama.cpp GGUF)."""

from axtorch.interop.gguf import from_gguf
from axtorch.interop.gguf_export import to_gguf
from axtorch.interop.hf import from_hf, to_hf

__all__ = ["from_gguf", "from_hf", "to_gguf", "to_hf"]
