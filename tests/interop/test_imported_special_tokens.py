"""An imported model's own special tokens, on the real SmolLM2-135M-Instruct and Gemma 3 270M GGUFs.

The data path reads the tokenizer ``init_from=gguf:`` writes (``load_pretrained``'s tokenizer part,
then ``load_or_train_tokenizer`` with ``data.tokenizer.eos_token`` left null). A plain document must
come out as transformers' tokenizer from the same GGUF encodes it, followed by its EOS: Gemma's
``<bos>`` first (``tokenizer.ggml.add_bos_token``), none for SmolLM2. A chat row must be exactly
transformers' ``apply_chat_template(tokenize=True)``: a template that writes ``{{ bos_token }}``
gets one BOS, not two. Generation stops on the model's end of turn (llama.cpp's end-of-generation
tokens), and ``generate(chat=True)`` answers through the template as the CLI does and as
transformers' greedy ``generate`` does from ``apply_chat_template(add_generation_prompt=True)``.
"""

import json
import subprocess
import sys

import pytest
import torch
from registry_assets import transformers_gguf_model, transformers_gguf_tokenizer
from test_gguf_gemma3 import gemma3_gguf  # noqa: F401 (the fixture)
from test_gguf_smollm2 import smollm2_gguf  # noqa: F401 (the fixture)

from axtorch.data.chat import ChatSource, messages_document
from axtorch.data.corpus_tokenizer import load_or_train_tokenizer
from axtorch.data.document_tokens import NOT_TARGET, TOKEN_ID
from axtorch.data.packing import tokenize_documents
from axtorch.data.sources import JsonlSourceConfig, TextFilesSource
from axtorch.data.tokenizer import TokenizerConfig
from axtorch.infer import generate
from axtorch.infer.decoding import prompt_text
from axtorch.interop import from_gguf
from axtorch.interop.gguf import tokenizer_from_gguf
from axtorch.interop.hf import hf_tokenizer, save_hf_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.journey]

DOCUMENTS = ["The capital of France is Paris.\n", "def f(x):\n    return x ** 2\n"]
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
]
#: Gemma 3's chat template in short (its GGUF carries none): it writes BOS itself, the model's turn is
#: "model", a system turn is folded into the first user turn, and each turn ends with <end_of_turn>.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
MODELS = ["smollm2", "gemma3"]


@pytest.fixture(scope="module", params=MODELS)
def gguf_file(request):
    return request.getfixturevalue(f"{request.param}_gguf")


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_file):
    return transformers_gguf_tokenizer(gguf_file)


@pytest.fixture(scope="module")
def data_tokenizer(gguf_file, tmp_path_factory):
    """The tokenizer the data path reads after ``init_from=gguf:`` (``eos_token`` null)."""
    scratch = tmp_path_factory.mktemp("init_from")
    tokenizer_from_gguf(gguf_file).save(scratch / "pretrained_tokenizer.json")  # as load_pretrained does
    config = TokenizerConfig(path=str(scratch / "pretrained_tokenizer.json"))
    return load_or_train_tokenizer(config, TextFilesSource([]), tmp_path_factory.mktemp("cache"))


def test_a_plain_document_is_transformers_encoding_then_eos(data_tokenizer, reference_tokenizer, tmp_path):
    expected = [[*reference_tokenizer(text)["input_ids"], reference_tokenizer.eos_token_id] for text in DOCUMENTS]
    gemma = reference_tokenizer.bos_token == "<bos>"
    assert [ids[0] == reference_tokenizer.bos_token_id for ids in expected] == [gemma, gemma]
    assert data_tokenizer.document_ids(DOCUMENTS) == expected
    # In a streamed source and in the packed one, alike.
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    source = JsonlSourceConfig(paths=[str(tmp_path / "docs.jsonl")]).build()
    streamed = source.encode_documents(DOCUMENTS, data_tokenizer, mark_starts=True)
    assert [list(tokens & TOKEN_ID) for tokens in streamed] == expected
    packed, lengths, _ = tokenize_documents(source, data_tokenizer, 0.0, seed=0)
    assert packed.tolist() == [token for ids in expected for token in ids]
    assert lengths.tolist() == [len(ids) for ids in expected]


def test_a_chat_row_is_apply_chat_template_with_one_bos(data_tokenizer, reference_tokenizer, gguf_file, tmp_path):
    template = reference_tokenizer.chat_template
    source = ChatSource(TextFilesSource([]), None)
    if template is None:  # Gemma's GGUF: data.source.template=gemma.jinja
        template = GEMMA_TEMPLATE
        (tmp_path / "gemma.jinja").write_text(GEMMA_TEMPLATE)
        source = ChatSource(TextFilesSource([]), str(tmp_path / "gemma.jinja"))
    expected = reference_tokenizer.apply_chat_template(
        CONVERSATION, chat_template=template, tokenize=True, return_dict=True
    )["input_ids"]
    document = messages_document(CONVERSATION, "messages", "row 0")
    [tokens] = source.encode_documents([document], data_tokenizer, mark_starts=True)
    ids = (tokens & TOKEN_ID).tolist()
    print(f"{gguf_file.name}: {data_tokenizer.decode(ids)!r}")
    assert ids == expected
    if data_tokenizer.bos_id is not None:  # Gemma: the template's BOS, and no second one before it
        assert ids[0] == data_tokenizer.bos_id and ids.count(data_tokenizer.bos_id) == 1
    # The loss is on the assistant's turn only: its reply and its end of turn.
    targets = [token for token, flagged in zip(ids, tokens & NOT_TARGET) if not flagged]
    assert data_tokenizer.decode(targets).startswith("Paris.")


def test_generation_stops_at_the_models_end_of_turn(data_tokenizer, gguf_file):
    """Gemma: <eos> and <end_of_turn> (HF's generation_config.json for Gemma 3 lists 1 and 106);
    SmolLM2: <|im_end|> and <|endoftext|>; the trained run's tokenizer keeps them (``save``/``load``)."""
    ends = {data_tokenizer.decode([token]) for token in data_tokenizer.stop_ids}
    expected = {"<eos>", "<end_of_turn>"} if "gemma" in gguf_file.name else {"<|im_end|>", "<|endoftext|>"}
    assert ends == expected


def test_an_hf_export_keeps_bos_end_of_turn_and_template(data_tokenizer, reference_tokenizer, tmp_path):
    """``axtorch-export to=hf:`` writes the tokenizer so that transformers reads what the model was
    trained on: Gemma's <bos> first (a post-processor: a generic tokenizer ignores ``add_bos_token``)."""
    save_hf_tokenizer(data_tokenizer, tmp_path)
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert [exported(text)["input_ids"] for text in DOCUMENTS] == [
        reference_tokenizer(t)["input_ids"] for t in DOCUMENTS
    ]
    assert exported.eos_token == data_tokenizer.eos_token
    assert exported.chat_template == data_tokenizer.settings.get("chat_template")
    reread, _ = hf_tokenizer(tmp_path)  # and axtorch reads it back with the same specials, BOS once
    assert reread.document_ids(DOCUMENTS) == data_tokenizer.document_ids(DOCUMENTS)
    assert reread.stop_ids == data_tokenizer.stop_ids


def _chat_reference(model_path, prompt_ids: list[int], stop_ids, max_new_tokens: int) -> list[int]:
    reference = transformers_gguf_model(model_path)
    output = reference.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=list(stop_ids),
        pad_token_id=0,
    )
    new = output[0, len(prompt_ids) :].tolist()
    return new[: next((i for i, token in enumerate(new) if token in stop_ids), len(new))]


def test_library_chat_equals_the_cli_and_transformers_from_apply_chat_template(smollm2_gguf):  # noqa: F811
    question = "What is the capital of France?"
    model, _, tokenizer = from_gguf(smollm2_gguf)
    reference_tokenizer = transformers_gguf_tokenizer(smollm2_gguf)
    prompt_ids = reference_tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]

    [ours] = generate(model.eval(), tokenizer, [question], max_new_tokens=24, chat=True)
    [from_ids] = generate(model, tokenizer, [prompt_ids], max_new_tokens=24)
    assert ours.token_ids == from_ids.token_ids and ours.finish_reason == "eos", ours
    assert ours.token_ids == _chat_reference(smollm2_gguf, prompt_ids, tokenizer.stop_ids, 24)

    command = [sys.executable, "-m", "axtorch.generate", f"gguf={smollm2_gguf}", "chat=true", f"prompt={question}"]
    result = subprocess.run([*command, "max_new_tokens=24"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rendered = tokenizer.decode(prompt_ids)
    print(f"{question!r} -> {ours.text!r}")
    assert result.stdout == rendered + ours.text + "\n"


def test_gemma_chat_prompt_is_apply_chat_template_with_one_bos(gemma3_gguf):  # noqa: F811
    """Gemma 3 270M is a base model: it does not end a turn by itself, so this checks the prompt
    (its <end_of_turn> stop is in ``test_generation_stops_at_the_models_end_of_turn``)."""
    model, _, tokenizer = from_gguf(gemma3_gguf)
    tokenizer.settings["chat_template"] = GEMMA_TEMPLATE  # the GGUF has none
    reference = transformers_gguf_tokenizer(gemma3_gguf)
    conversation = [
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome"},
        {"role": "user", "content": "Capital of France?"},
    ]
    prompt_ids = reference.apply_chat_template(
        conversation, chat_template=GEMMA_TEMPLATE, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert tokenizer.encode(prompt_text(tokenizer, conversation)) == prompt_ids
    assert prompt_ids[0] == tokenizer.bos_id and prompt_ids.count(tokenizer.bos_id) == 1
    [ours] = generate(model.eval(), tokenizer, [conversation], max_new_tokens=6, chat=True)
    [from_ids] = generate(model, tokenizer, [prompt_ids], max_new_tokens=6)
    print(f"{conversation[-1]['content']!r} -> {ours.text!r}")
    assert ours.token_ids == from_ids.token_ids
