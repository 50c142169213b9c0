"""Gemma 3 (text): five sliding-window layers to one global one, QK-norm, and a RoPE base of
its own for the local layers (see ``gemma_layout``); HF's ``model_type`` is ``gemma3_text``."""

from __future__ import annotations

from axtorch.interop.families.gemma_layout import gemma_layout_family, llama_cpp_layout

GEMMA3 = gemma_layout_family(
    "gemma3_text",
    "Gemma3ForCausalLM",
    every=6,
    qk_norm=True,
    local_rope=True,
    gguf=llama_cpp_layout("gemma3", every=6, layers_27b=62, local_base=10000.0),
)
