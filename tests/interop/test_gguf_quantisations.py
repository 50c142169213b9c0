"""Every GGUF tensor format that llama.cpp files use loads into axtorch as transformers loads it.

Files with the formats the ``gguf`` package can quantise (F16, BF16, Q8_0, Q5_1, Q5_0, Q4_1,
Q4_0) are written by ``to_gguf``; the dequantised weights must lie within each format's rounding
of the model's, and the logits must equal those of transformers' own GGUF loader. The ``gguf``
package cannot quantise K-quants, so Q4_K, Q5_K and Q6_K files hold random valid blocks; Q4_K
is also checked against an independent decoder written from llama.cpp's block layout.
"""

import numpy as np
import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.data.tokenizer import train_byte_level_bpe
from axtorch.interop import gguf_export
from axtorch.interop.gguf import from_gguf
from axtorch.interop.gguf_export import to_gguf
from axtorch.models import CausalLMInput

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

#: Largest elementwise error of a format, relative to the largest weight of the matrix.
ROUNDING = {"f16": 1e-3, "bf16": 8e-3, "q8_0": 1e-2, "q5_1": 4e-2, "q5_0": 6e-2, "q4_1": 8e-2, "q4_0": 0.13}


@pytest.fixture(scope="module")
def tokenizer():
    corpus = "def main():\n    return 0\n" * 40 + "the quick brown fox jumps over the lazy dog\n" * 40
    return train_byte_level_bpe(iter([corpus]), 300, "<|endoftext|>")


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    # Width 256 and feed-forward 512: K-quant super-blocks (256 values) divide the rows.
    overrides = ["model.dim=256", "model.decoder.num_layers=1", "model.decoder.layer.feed_forward.hidden_dim=512"]
    config = load_experiment_config(["experiment=debug", f"model.vocab_size={tokenizer.vocab_size}", *overrides]).model
    built = config.build()
    built.init_weights()
    return built.eval()


def _compare_with_transformers(path, tokenizer) -> tuple[torch.nn.Module, float]:
    ids = torch.tensor([tokenizer.encode("def main():\n    return the quick brown fox")])
    ours = from_gguf(path)[0]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        expected, got = theirs(ids).logits, ours(CausalLMInput(ids)).logits
    return ours, float((got - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("dtype", list(ROUNDING))
def test_each_quantisable_format_dequantises_within_its_rounding_and_as_transformers_does(
    tmp_path, tokenizer, model, dtype
):
    to_gguf(model, tokenizer, tmp_path / "model.gguf", dtype)
    loaded, difference = _compare_with_transformers(tmp_path / "model.gguf", tokenizer)
    assert difference < 1e-5
    for name, weight in model.state_dict().items():
        error = (loaded.state_dict()[name] - weight).abs().max() / weight.abs().max()
        assert error < ROUNDING[dtype], (name, float(error))


def _random_blocks(kind, rows: int, columns: int, generator: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks whose f16 scales are small and finite (any other bytes are valid)."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = generator.integers(0, 256, (rows, columns // block_values, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    scale_offsets = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (block_bytes - 2,)}[kind.name]
    for offset in scale_offsets:
        blocks[..., offset : offset + 2] = scale
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_files_load_as_transformers_loads_them(tmp_path, tokenizer, model, kind, monkeypatch):
    quant = gguf.GGMLQuantizationType[kind]
    generator = np.random.default_rng(0)
    write = gguf_export._add_tensor

    def add_k_quant(writer, name, array, dtype):
        if array.ndim < 2 or array.shape[-1] % 256:  # as llama.cpp, another format where no super-block fits
            return write(writer, name, array, dtype)
        writer.add_tensor(name, _random_blocks(quant, *array.shape, generator), raw_dtype=quant)

    monkeypatch.setattr(gguf_export, "_add_tensor", add_k_quant)
    to_gguf(model, tokenizer, tmp_path / "model.gguf", "f32")
    loaded, difference = _compare_with_transformers(tmp_path / "model.gguf", tokenizer)
    assert difference < 1e-5
    if kind == "Q4_K":
        reader = gguf.GGUFReader(tmp_path / "model.gguf")
        tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
        expected = _q4_k_reference(np.asarray(tensor.data).reshape(-1, 144)).reshape(
            loaded.state_dict()["decoder.layers.0.feed_forward.down_proj.weight"].shape
        )
        torch.testing.assert_close(
            loaded.state_dict()["decoder.layers.0.feed_forward.down_proj.weight"], torch.from_numpy(expected)
        )


def _q4_k_reference(blocks: np.ndarray) -> np.ndarray:
    """Q4_K decoded as llama.cpp's ``dequantize_row_q4_K`` does, block by block (independent of gguf-py)."""
    out = []
    for block in blocks:
        d = float(np.frombuffer(block[0:2].tobytes(), dtype=np.float16)[0])
        dmin = float(np.frombuffer(block[2:4].tobytes(), dtype=np.float16)[0])
        scales, qs = block[4:16].astype(np.int32), block[16:144].astype(np.int32)

        values = []
        for group in range(4):  # 64 values per group: low nibbles, then high nibbles of 32 bytes
            q = qs[32 * group : 32 * group + 32]
            (s1, m1), (s2, m2) = _scale_min(scales, 2 * group), _scale_min(scales, 2 * group + 1)
            values += [d * s1 * (q & 0xF) - dmin * m1, d * s2 * (q >> 4) - dmin * m2]
        out.append(np.concatenate(values))
    return np.stack(out).astype(np.float32)


def _scale_min(scales: np.ndarray, j: int) -> tuple[int, int]:
    """Sub-block ``j``'s 6-bit scale and min, packed in 12 bytes (llama.cpp's ``get_scale_min_k4``)."""
    if j < 4:
        return scales[j] & 63, scales[j + 4] & 63
    return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)
