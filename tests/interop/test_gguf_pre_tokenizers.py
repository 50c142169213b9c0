"""llama.cpp's ``command-r``, ``deepseek-llm`` and ``deepseek-coder`` pre-tokenizers, rebuilt for HF ``tokenizers``.

Two independent references. llama.cpp (``src/llama-vocab.cpp``, ``regex_exprs`` per pre-type)
applies a list of regexes one after another, each splitting the pieces the previous left and
keeping both matches and the text between them (``unicode_regex_split``); here that list is
transcribed from llama.cpp and run with the ``regex`` package. The models' own tokenizer.json
``pre_tokenizer``: transformers' ``CohereTokenizer`` for Command R, the published JSON of
deepseek-ai/deepseek-llm-7b-base and deepseek-coder-6.7b-instruct for DeepSeek, whose letter
class is rebuilt from its code point ranges rather than from the string axtorch writes.

Where llama.cpp and tokenizer.json differ, axtorch follows tokenizer.json, and the tests pin how:
DeepSeek LLM's digit runs (llama.cpp ``\\p{N}+``, tokenizer.json one digit a piece: the same ids
for a vocabulary trained on single digits, as DeepSeek's was), and spaces from U+0800 up, which
llama.cpp's regex engine sees as a vertical tab and so never matches by DeepSeek's ranges.
"""

# The texts are full-width and curly punctuation on purpose: what DeepSeek's ranges split.
# ruff: noqa: RUF001

import itertools
import json

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from axtorch.interop.gguf import PRE_TOKENIZERS, tokenizer_from_gguf

regex = pytest.importorskip("regex")  # installed with transformers
gguf = pytest.importorskip("gguf")

KINDS = ["command-r", "deepseek-llm", "deepseek-coder"]
SPECIAL = "<|endoftext|>"
TEXTS = [
    "Café naïve façade Ærøskøbing, Ελληνικά κείμενα, Русский текст, Ǆemal ǅ ǆ",
    "日本語のテキストと漢字, 中文文本, 한국어 텍스트, العربية نص, हिन्दी पाठ",
    "  leading\tand\t\ttabs\r\n\r\nCRLF   trailing   ",
    "x \n y\n\n\n  z  \t",
    "   ",
    "",
    "1 12 123 1234 12345 1234567890 3.14159 -42 1e10 v2.0.1 x86_64",
    "½ ²³ ٣٤٥ २३ Ⅻ ① 12٣",
    'def f(x):\n    return x**2 + 1  # ok\n\tif a != b: {}[]<>\n    s = "a\\tb" @ 0x1F',
    "Hello, world! ¿Qué? «quoted» — dash… ‘curly’ “quotes”",
    "，。！？（全角）［ｘ］Ｈｅｌｌｏ ｗｏｒｌｄ１２３",
    "emoji 🚀🎉 👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷",
    "I'm you're he'll we've they'd it's I'M YOU'LL don't 'quoted'",
    "e\u0301 decomposed, nbsp\u00a0here, \u2103 \u212a \u2126 \ufb01",
    "trailing \n",
    "done 🚀  ",
    "مرحبا  بالعالم \t",
]
#: Spaces from U+0800 up: matched by DeepSeek's ranges in tokenizer.json, never by llama.cpp's engine.
WIDE_SPACES = ["。\u3000。 a\u3000b\u3000\u3000c", "thin\u2009space en\u2002space\u205f!", "line\u2028sep"]

#: llama.cpp's GPT-2 regex (run by its hand-written ``unicode_regex_split_custom_gpt2``).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
#: DeepSeek LLM's cased letters, as the code point ranges of its tokenizer.json letter class.
DEEPSEEK_LETTER_RANGES = [
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
    (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x376), (0x377, 0x377), (0x37B, 0x37D),
    (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C), (0x38E, 0x3A1), (0x3A3, 0x3F5),
    (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD),
    (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A),
    (0x1E00, 0x1F15), (0x1F18, 0x1F1D), (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57),
    (0x1F59, 0x1F59), (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4),
    (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3),
    (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102),
    (0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124),
    (0x2126, 0x2126), (0x2128, 0x2128), (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139),
    (0x213C, 0x213F), (0x2145, 0x2149), (0x214E, 0x214E), (0x2183, 0x2183), (0x2184, 0x2184),
    (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE), (0x2CF2, 0x2CF2), (0x2CF3, 0x2CF3),
    (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E),
    (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A),
    (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2),
    (0x118A0, 0x118DF), (0x1E900, 0x1E943),
]  # fmt: skip


def _class(ranges):
    return "".join(chr(low) if low == high else f"{chr(low)}-{chr(high)}" for low, high in ranges)


DEEPSEEK_LETTERS = f"\\s?[{_class(DEEPSEEK_LETTER_RANGES)}]+"
PUNCTUATION_RANGES = [
    (0x21, 0x2F),
    (0x3A, 0x7E),
    (0xFF01, 0xFF0F),
    (0xFF1A, 0xFF5E),
    (0x2018, 0x201F),
    (0x3000, 0x3002),
]
DEEPSEEK_PUNCTUATION = f"\\s?[{_class(PUNCTUATION_RANGES)}]+"
DEEPSEEK_CJK = f"[{_class([(0x4E00, 0x9FA5), (0x800, 0x4E00), (0xAC00, 0xD7FF)])}]+"
#: llama.cpp's ``regex_exprs`` for each pre-type.
LLAMA_CPP_REGEXES = {
    "command-r": [r"\p{N}", GPT2],
    "deepseek-llm": ["[\r\n]", DEEPSEEK_LETTERS, DEEPSEEK_PUNCTUATION, r"\s+$", DEEPSEEK_CJK, r"\p{N}+"],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"],
}


def _isolated(pattern):
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def _deepseek_json(*patterns):
    digits = {"type": "Digits", "individual_digits": True}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {"type": "Sequence", "pretokenizers": [*map(_isolated, patterns), digits, byte_level]}


#: The models' tokenizer.json pre_tokenizers (deepseek-ai/deepseek-llm-7b-base, deepseek-coder-6.7b-instruct).
DEEPSEEK_TOKENIZER_JSON = {
    "deepseek-llm": _deepseek_json("[\r\n]", DEEPSEEK_LETTERS, DEEPSEEK_PUNCTUATION, r"\s+$", DEEPSEEK_CJK),
    "deepseek-coder": _deepseek_json("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK),
}


def _bytes_to_unicode():
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + len(table) - len(printable))
    return table


BYTE_CHARS = _bytes_to_unicode()
UNBYTE = {char: byte for byte, char in BYTE_CHARS.items()}


def llama_cpp_pieces(text, regexes):
    """``unicode_regex_split``: each regex splits every piece, keeping matches and the gaps between.

    Translated from ECMAScript as llama.cpp runs it: ``$`` ends the piece only (Python's ``\\Z``),
    and a non-ASCII space is matched as the vertical tab llama.cpp substitutes for it.
    """
    pieces = [text]
    for expression in regexes:
        pattern = regex.compile(expression.replace("$", r"\Z"))
        split = []
        for piece in pieces:
            seen = "".join("\v" if ord(c) > 127 and regex.match(r"\p{White_Space}", c) else c for c in piece)
            end = 0
            for match in pattern.finditer(seen):
                split += [piece[end : match.start()], piece[match.start() : match.end()]]
                end = match.end()
            split.append(piece[end:])
        pieces = [piece for piece in split if piece]
    return pieces


def axtorch_pieces(kind, text):
    pieces = PRE_TOKENIZERS[kind]().pre_tokenize_str(text)
    return [bytes(UNBYTE[char] for char in piece).decode("utf-8") for piece, _ in pieces]


def _single_digits(pieces):
    """tokenizer.json's digits: llama.cpp's ``\\p{N}+`` runs, one digit a piece."""
    return [part for piece in pieces for part in (piece if regex.fullmatch(r"\p{N}+", piece) else [piece])]


@pytest.mark.parametrize("kind", KINDS)
def test_pieces_are_llama_cpps(kind):
    texts = TEXTS + WIDE_SPACES if kind == "command-r" else TEXTS
    for text in texts:
        expected = llama_cpp_pieces(text, LLAMA_CPP_REGEXES[kind])
        if kind == "deepseek-llm":
            expected = _single_digits(expected)
        assert axtorch_pieces(kind, text) == expected, text


def test_deepseek_llm_keeps_llama_cpps_digit_runs_only_as_single_digits():
    pieces = llama_cpp_pieces("x 2024 ٣٤", LLAMA_CPP_REGEXES["deepseek-llm"])
    assert pieces == ["x", " ", "2024", " ", "٣٤"]
    assert axtorch_pieces("deepseek-llm", "x 2024 ٣٤") == ["x", " ", "2", "0", "2", "4", " ", "٣", "٤"]


@pytest.mark.parametrize("kind", ["deepseek-llm", "deepseek-coder"])
def test_deepseek_spaces_beyond_u0800_split_as_tokenizer_json_not_as_llama_cpp(kind):
    # tokenizer.json's CJK range U+0800-U+4E00 holds U+2009 and U+3000 (and its punctuation range
    # U+3000-U+3002 the ideographic space); llama.cpp matches those spaces only as \s.
    text = "thin\u2009space \u3002\u3000\u3002"
    assert llama_cpp_pieces(text, LLAMA_CPP_REGEXES[kind]) == ["thin", "\u2009space", " ", "\u3002", "\u3000", "\u3002"]
    ideographic = {"deepseek-llm": ["\u3002\u3000\u3002"], "deepseek-coder": ["\u3002", "\u3000\u3002"]}[kind]
    assert axtorch_pieces(kind, text) == ["thin", "\u2009", "space", " ", *ideographic]


@pytest.mark.parametrize("kind", KINDS)
def test_the_pre_tokenizer_is_the_models_tokenizer_json(kind):
    probe = tokenizers.Tokenizer(models.BPE())
    probe.pre_tokenizer = PRE_TOKENIZERS[kind]()
    ours = json.loads(probe.to_str())["pre_tokenizer"]
    if kind == "command-r":
        transformers = pytest.importorskip("transformers")
        cohere = transformers.CohereTokenizer(vocab={"a": 0, "<BOS_TOKEN>": 1, "<|END_OF_TURN_TOKEN|>": 2}, merges=[])
        assert ours == json.loads(cohere.backend_tokenizer.to_str())["pre_tokenizer"]
    else:
        assert ours == DEEPSEEK_TOKENIZER_JSON[kind]


def _bpe(word, ranks):
    """Byte-level BPE of one piece: merge the lowest-ranked adjacent pair, leftmost first, until none is left."""
    parts = [BYTE_CHARS[byte] for byte in word.encode("utf-8")]
    while len(parts) > 1:
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(itertools.pairwise(parts)))
        if rank == len(ranks):
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def llama_cpp_ids(text, kind, vocab, ranks, single_digits=False):
    """Special tokens partitioned out whole, each fragment between them split and merged as llama.cpp does."""
    ids = []
    for i, fragment in enumerate(text.split(SPECIAL)):
        pieces = llama_cpp_pieces(fragment, LLAMA_CPP_REGEXES[kind])
        pieces = _single_digits(pieces) if single_digits else pieces
        ids += ([vocab[SPECIAL]] if i else []) + [vocab[part] for piece in pieces for part in _bpe(piece, ranks)]
    return ids


def _trained(kind):
    """A byte-level BPE trained with this pre-tokenizer: (vocabulary, merges)."""
    inner = tokenizers.Tokenizer(models.BPE())
    inner.pre_tokenizer = PRE_TOKENIZERS[kind]()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(TEXTS * 5, trainer=trainer)
    model = json.loads(inner.to_str())["model"]
    return model["vocab"], [tuple(merge) for merge in model["merges"]]


def _write_gguf(path, kind, vocab, merges):
    """A vocabulary-only GGUF as llama.cpp reads it."""
    tokens = sorted(vocab, key=vocab.get)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(kind)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t == SPECIAL else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(merge) for merge in merges])
    writer.add_eos_token_id(vocab[SPECIAL])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _trained_gguf(kind, path):
    """A byte-level BPE trained with this pre-tokenizer, written as a GGUF: (vocabulary, merge ranks)."""
    vocab, merges = _trained(kind)
    _write_gguf(path, kind, vocab, merges)
    return vocab, {merge: rank for rank, merge in enumerate(merges)}


@pytest.mark.parametrize("kind", KINDS)
def test_a_gguf_with_this_pre_tokenizer_encodes_as_llama_cpp(tmp_path, kind):
    vocab, ranks = _trained_gguf(kind, tmp_path / f"{kind}.gguf")
    back = tokenizer_from_gguf(tmp_path / f"{kind}.gguf")
    texts = [*TEXTS, *(WIDE_SPACES if kind == "command-r" else []), f"end{SPECIAL}after {SPECIAL}\n 2024"]
    for text in texts:
        ids = back.encode(text)
        assert ids == llama_cpp_ids(text, kind, vocab, ranks, single_digits=kind == "deepseek-llm"), text
        assert back.decode(ids) == text, text
        # DeepSeek LLM's single digits give llama.cpp's ids where digits are bytes: no merge joins two
        # (a run of multi-byte digits, as Devanagari's, may take a merge learned inside words).
        if regex.search(r"(?![0-9])\p{N}", text) is None:
            assert ids == llama_cpp_ids(text, kind, vocab, ranks), text
    assert any(len(token) > 1 and not token.startswith("<") for token in vocab)  # merges were exercised


#: Pre-tokens put into the vocabulary whole, which the trained merges do not reach.
WHOLE_WORDS = ["Cửa", " Việt", " Nẵng", " Huế", " Đà"]


def _byte_level(text):
    return "".join(BYTE_CHARS[byte] for byte in text.encode("utf-8"))


def _reference(kind, vocab, merges, ignore_merges):
    """HF ``tokenizers``' own BPE over this vocabulary, with or without ``ignore_merges``."""
    inner = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    inner.pre_tokenizer = PRE_TOKENIZERS[kind]()
    inner.add_special_tokens([tokenizers.AddedToken(SPECIAL, special=True, normalized=False)])
    return inner


def llama_cpp_ignore_merges_ids(text, kind, vocab, ranks):
    """llama.cpp with ``ignore_merges``: a pre-token in the vocabulary is one token, any other is merged."""
    ids = []
    for i, fragment in enumerate(text.split(SPECIAL)):
        ids += [vocab[SPECIAL]] if i else []
        for piece in axtorch_pieces(kind, fragment):
            whole = _byte_level(piece)
            ids += [vocab[whole]] if whole in vocab else [vocab[part] for part in _bpe(piece, ranks)]
    return ids


def test_llama_bpe_takes_a_pre_token_in_the_vocabulary_whole_as_llama_3_does(tmp_path):
    vocab, merges = _trained("llama-bpe")
    for word in WHOLE_WORDS:
        assert _byte_level(word) not in vocab
        vocab[_byte_level(word)] = len(vocab)
    _write_gguf(tmp_path / "llama3.gguf", "llama-bpe", vocab, merges)
    back = tokenizer_from_gguf(tmp_path / "llama3.gguf")
    whole, merged = (_reference("llama-bpe", vocab, merges, flag) for flag in (True, False))
    ranks = {merge: rank for rank, merge in enumerate(merges)}
    texts = [*TEXTS, "Cửa Việt", f"Đà Nẵng{SPECIAL} Cửa Việt Huế Huế\n Việt"]
    for text in texts:
        ids = back.encode(text)
        assert ids == whole.encode(text).ids == llama_cpp_ignore_merges_ids(text, "llama-bpe", vocab, ranks), text
        assert back.decode(ids) == text
    assert back.encode("Cửa Việt") == [vocab[_byte_level("Cửa")], vocab[_byte_level(" Việt")]]
    assert len(merged.encode("Cửa Việt").ids) > 2  # the merges alone cut the words up, as transformers' conversion does


@pytest.mark.parametrize("kind", ["gpt-2", "qwen2", *KINDS])
def test_other_pre_tokenizers_merge_as_llama_cpp_does_for_them(tmp_path, kind):
    vocab, merges = _trained("llama-bpe")
    for word in WHOLE_WORDS:
        vocab[_byte_level(word)] = len(vocab)
    _write_gguf(tmp_path / f"{kind}.gguf", kind, vocab, merges)
    back = tokenizer_from_gguf(tmp_path / f"{kind}.gguf")
    merged = _reference(kind, vocab, merges, ignore_merges=False)
    for text in [*TEXTS, "Cửa Việt Đà Nẵng Huế"]:
        assert back.encode(text) == merged.encode(text).ids, text
