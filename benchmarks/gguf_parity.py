"""GGUF parity: every architecture and tensor format ``from_gguf`` reads, against a reference.

    .venv/bin/python benchmarks/gguf_parity.py

Architectures: a small random axtorch model of each family is exported with ``to_gguf`` (f32)
and read back by ``from_gguf`` and, where it reads the architecture, by transformers' own GGUF
loader; each figure is max |logits - the model's logits| / max |the model's logits|. Formats: a
debug Llama is written in each format the ``gguf`` package quantises, and in llama.cpp's K-quants
as random valid blocks (the package cannot quantise those); each file is loaded by axtorch and by
transformers (both dequantise through the ``gguf`` package, so they agree exactly; the Q4_K
decoder is checked independently in ``tests/interop/test_gguf_quantisations.py``), and the
quantised weights and logits are compared with the model's. Prints markdown tables.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.data.tokenizer import Tokenizer, train_byte_level_bpe
from axtorch.interop import gguf_export
from axtorch.interop.gguf import from_gguf
from axtorch.interop.gguf_export import to_gguf
from axtorch.models import CausalLM, CausalLMInput

SMALL = ["experiment=debug", "model.dim=64", "model.decoder.num_layers=2", "model.decoder.layer.attention.num_heads=4"]
#: architecture row -> (overrides, whether transformers' GGUF loader reads the file). The MoE
#: widths are transformers' defaults: its loader ignores the widths in the metadata.
ARCHITECTURES: dict[str, tuple[list[str], bool]] = {
    "llama": ([], True),
    "llama (Mistral, window 8)": (["model=mistral_tiny", "model.decoder.layer.attention.mask.window=8"], False),
    "llama (Mixtral, 8 experts)": (["model=mixtral_tiny"], False),
    "qwen2": (["model.decoder.layer.attention.qkv_projection.bias=true"], True),
    "qwen3": (["model=qwen3_tiny", "model.decoder.layer.attention.head_dim=128"], True),
    "gemma": (
        ["model.embedding.scale_by_sqrt_dim=true", "model.decoder.layer.feed_forward.activation=gelu_tanh"],
        False,
    ),
    "qwen3moe": (
        [
            "model=qwen3_moe_tiny",
            "model.decoder.layer.attention.head_dim=128",
            "model.decoder.layer.feed_forward.hidden_dim=768",
        ],
        True,
    ),
    "qwen2moe": (
        [
            "model=qwen3_moe_tiny",
            "model/qk_norm=none",
            "model.decoder.layer.attention.head_dim=null",
            "model/shared_experts=swiglu",
            "model.decoder.layer.feed_forward.hidden_dim=1408",
            "model.decoder.layer.feed_forward.shared_experts.hidden_dim=5632",
            "model.decoder.layer.feed_forward.shared_expert_gate=true",
            "model.decoder.layer.feed_forward.router.normalize_top_k=false",
            "model.decoder.layer.attention.qkv_projection.bias=true",
        ],
        True,
    ),
}
QUANTISABLE = ["f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"]
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]


def _model(tokenizer: Tokenizer, overrides: list[str]) -> CausalLM:
    config = load_experiment_config([*overrides, f"model.vocab_size={tokenizer.vocab_size}"]).model
    torch.manual_seed(0)
    model = config.build()
    model.init_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def _transformers_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return theirs.eval()(ids).logits


@torch.no_grad()
def architecture_rows(tokenizer: Tokenizer, directory: Path) -> list[str]:
    rows = []
    for name, (overrides, transformers_reads) in ARCHITECTURES.items():
        model = _model(tokenizer, [*SMALL, *overrides])
        path = directory / f"{name.split()[0]}-{len(rows)}.gguf"
        to_gguf(model, tokenizer, path, "f32")
        ids = torch.randint(0, tokenizer.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
        expected = model(CausalLMInput(ids)).logits
        ours = _relative(from_gguf(path)[0](CausalLMInput(ids)).logits, expected)
        theirs: Optional[float] = _relative(_transformers_logits(path, ids), expected) if transformers_reads else None
        rows.append(f"| {name} | {ours:.1e} | {'not read' if theirs is None else f'{theirs:.1e}'} |")
    return rows


@torch.no_grad()
def format_rows(tokenizer: Tokenizer, directory: Path) -> list[str]:
    import gguf

    overrides = ["model.dim=256", "model.decoder.num_layers=1", "model.decoder.layer.feed_forward.hidden_dim=512"]
    model = _model(tokenizer, ["experiment=debug", *overrides])
    ids = torch.tensor([tokenizer.encode("def main():\n    return the quick brown fox")])
    rows = []

    expected = model(CausalLMInput(ids)).logits

    def compare(path: Path, label: str, against_model: bool) -> None:
        loaded = from_gguf(path)[0]
        ours = loaded(CausalLMInput(ids)).logits
        row = f"| {label} | {_relative(ours, _transformers_logits(path, ids)):.1e} |"
        if against_model:
            weights = max(
                float((loaded.state_dict()[name] - weight).abs().max() / weight.abs().max())
                for name, weight in model.state_dict().items()
                if weight.dim() == 2
            )
            row += f" {weights:.1e} | {_relative(ours, expected):.1e} |"
        else:
            row += " - | - |"
        rows.append(row)

    for dtype in ["f32", *QUANTISABLE]:
        to_gguf(model, tokenizer, directory / f"{dtype}.gguf", dtype)
        compare(directory / f"{dtype}.gguf", dtype.upper(), against_model=True)
    write = gguf_export._add_tensor
    generator = np.random.default_rng(0)
    for kind_name in K_QUANTS:
        kind = gguf.GGMLQuantizationType[kind_name]
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]

        def add_k_quant(writer, name, array, dtype, kind=kind, block_values=block_values, block_bytes=block_bytes):
            if array.ndim < 2 or array.shape[-1] % block_values:
                return write(writer, name, array, dtype)
            blocks = generator.integers(0, 256, (array.shape[0], array.shape[1] // block_values, block_bytes))
            blocks = blocks.astype(np.uint8)
            scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
            for offset in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (block_bytes - 2,)}[kind.name]:
                blocks[..., offset : offset + 2] = scale
            writer.add_tensor(name, blocks.reshape(array.shape[0], -1), raw_dtype=kind)

        gguf_export._add_tensor = add_k_quant
        try:
            to_gguf(model, tokenizer, directory / f"{kind_name}.gguf", "f32")
        finally:
            gguf_export._add_tensor = write
        compare(directory / f"{kind_name}.gguf", f"{kind_name} (random blocks)", against_model=False)
    return rows


def main() -> None:
    corpus = "def main():\n    return 0\n" * 40 + "the quick brown fox jumps over the lazy dog 12345\n" * 40
    tokenizer = train_byte_level_bpe(iter([corpus]), 300, "<|endoftext|>")
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        print("## GGUF architectures (f32 export; relative max logits difference from the model)\n")
        print("| architecture | axtorch from_gguf | transformers' GGUF loader |\n|---|---|---|")
        print("\n".join(architecture_rows(tokenizer, directory)))
        print("\n## GGUF tensor formats (a debug Llama, dim 256)\n")
        print(
            "| format | logits: axtorch vs transformers, same file | weights: worst matrix vs the model "
            "| logits vs the f32 model |\n|---|---|---|---|"
        )
        print("\n".join(format_rows(tokenizer, directory)))


if __name__ == "__main__":
    main()
