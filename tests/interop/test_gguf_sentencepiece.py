"""GGUF SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``: Llama 2, Mistral, Phi-3)
give the ids of ``sentencepiece`` itself, byte fallback and whitespace included."""

import sysconfig
from pathlib import Path

import gguf
import pytest
import sentencepiece

from axtorch.interop.gguf import tokenizer_from_gguf

TEXTS = [
    "Hello world",
    "  leading spaces and  double   runs",
    "def main():\n    return 0\n\n\n",
    "digits 1234567 and 3.14159",
    "café naïve Ünïcödé",
    "中文 日本語 한국어",
    "emoji 😀👍🏽 done",
    "tabs\tand\r\nCRLF\r\n",
    "x" * 80,
    "",
    " ",
    "trailing   ",
]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """A SentencePiece BPE trained as Llama's was (byte fallback, digits split, no normalisation)."""
    root = tmp_path_factory.mktemp("spm")
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    (root / "corpus.txt").write_text("\n".join(path.read_text(errors="replace") for path in sources))
    sentencepiece.SentencePieceTrainer.train(
        input=str(root / "corpus.txt"),
        model_prefix=str(root / "m"),
        vocab_size=1200,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        max_sentence_length=100_000,
        minloglevel=2,
    )
    return sentencepiece.SentencePieceProcessor(model_file=str(root / "m.model")), root


def _vocab_gguf(processor, path: Path) -> None:
    """A vocabulary-only GGUF, written as llama.cpp's converter writes a SentencePiece model."""

    def kind(i: int) -> int:
        if processor.is_unknown(i):
            return gguf.TokenType.UNKNOWN
        if processor.is_control(i):
            return gguf.TokenType.CONTROL
        if processor.is_byte(i):
            return gguf.TokenType.BYTE
        return gguf.TokenType.UNUSED if processor.is_unused(i) else gguf.TokenType.NORMAL

    size = processor.get_piece_size()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([processor.id_to_piece(i) for i in range(size)])
    writer.add_token_scores([processor.get_score(i) for i in range(size)])
    writer.add_token_types([kind(i) for i in range(size)])
    writer.add_bos_token_id(processor.bos_id())
    writer.add_eos_token_id(processor.eos_id())
    writer.add_unk_token_id(processor.unk_id())
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_ids_and_text_equal_sentencepiece(spm_model):
    processor, root = spm_model
    _vocab_gguf(processor, root / "vocab.gguf")
    tokenizer = tokenizer_from_gguf(root / "vocab.gguf")
    assert tokenizer.eos_id == processor.eos_id() and tokenizer.vocab_size == processor.get_piece_size()
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == processor.encode(text), text
        assert tokenizer.decode(ids) == processor.decode(ids), text
    assert any(processor.is_byte(i) for i in processor.encode("中文 😀"))  # the fallback was exercised


def test_control_tokens_in_text_are_their_ids_as_in_transformers(spm_model):
    processor, root = spm_model
    _vocab_gguf(processor, root / "vocab-control.gguf")
    tokenizer = tokenizer_from_gguf(root / "vocab-control.gguf")
    # sentencepiece reads "</s>" as characters; transformers' and llama.cpp's chat templates need it whole.
    assert tokenizer.encode("hi</s>")[-1] == processor.eos_id()
