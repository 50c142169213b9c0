"""Gemma 2: sliding-window and global layers in turn, sandwich norms, and soft-capped attention
scores and final logits (see ``gemma_layout``)."""

from __future__ import annotations

from axtorch.interop.families.gemma_layout import gemma_layout_family, llama_cpp_layout

GEMMA2 = gemma_layout_family(
    "gemma2",
    "Gemma2ForCausalLM",
    every=2,
    qk_norm=False,
    local_rope=False,
    gguf=llama_cpp_layout("gemma2", every=2, layers_27b=46, local_base=None),
)
