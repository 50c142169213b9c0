"""data=chat: conversations rendered with the tokenizer's chat template, the loss on the assistant's
turns only, one conversation per document (document masking), streamed and resumed exactly."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.data import ChatSourceConfig, DataConfig, StreamingDataModule, TokenizerConfig, build_data
from axtorch.data.batches import IGNORED_LABEL
from axtorch.data.tokenizer import TOKENIZER_SETTINGS_FILE, train_byte_level_bpe

#: ChatML, as SmolLM2 and Qwen write it.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "river", "stone", "bird", "fish"]
BATCH, SEQ_LEN = 4, 128


def conversations(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)

    def words() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))

    chats = []
    for index in range(count):
        turns = [{"role": "system", "content": f"chat {index}"}] if index % 3 == 0 else []
        for _ in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": words()}, {"role": "assistant", "content": f"A{index} " + words()}]
        chats.append(turns)
    return chats


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chat")
    chats = conversations(120)
    texts = [message["content"] for chat in chats for message in chat]
    tokenizer = train_byte_level_bpe(iter(texts), vocab_size=400, eos_token="<|im_end|>")
    tokenizer.save(root / "tokenizer.json")
    (root / TOKENIZER_SETTINGS_FILE).write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    return root


def chat_config(root: Path, **overrides) -> DataConfig:
    settings = {
        "source": ChatSourceConfig(paths=[str(root / "chat.jsonl")]),
        "tokenizer": TokenizerConfig(path=str(root / "tokenizer.json"), eos_token="<|im_end|>"),
        "seq_len": SEQ_LEN,
        "cache_dir": str(root / "cache"),
        "streams": 2,
        "val_fraction": 0.1,
        "document_masking": True,
        **overrides,
    }
    return DataConfig(**settings)


@pytest.fixture(scope="module")
def data(corpus) -> StreamingDataModule:
    built = build_data(chat_config(corpus))
    assert isinstance(built, StreamingDataModule)
    return built


def test_the_loss_is_on_the_assistant_turns_only(data):
    batch = next(data.train_batches(BATCH))
    targets = batch["labels"] != IGNORED_LABEL
    for row in range(BATCH):
        text = data.tokenizer.decode(batch["labels"][row][targets[row]].tolist())
        # Every trained-on token is an assistant reply or its end of turn; no prompt text leaks in.
        assert "<|im_start|>" not in text and "user" not in text and "system" not in text
        assert text.count("<|im_end|>") >= 1
    decoded = data.tokenizer.decode(batch["input_ids"][0].tolist())
    assert "<|im_start|>user\n" in decoded and "<|im_start|>assistant\nA" in decoded


def test_each_conversation_is_its_own_document(data):
    batch = next(data.train_batches(BATCH))
    ids, segments, positions = batch["input_ids"], batch["segment_ids"], batch["positions"]
    for row in range(BATCH):
        starts = torch.nonzero(positions[row] == 0).flatten().tolist()
        assert starts[0] == 0 and segments[row].tolist() == sorted(segments[row].tolist())
        for start in starts[1:]:  # a conversation starts after its predecessor's last turn
            text = data.tokenizer.decode(ids[row, start:].tolist())
            assert text.startswith("<|im_start|>") or "<|im_start|>".startswith(text)
            assert segments[row, start] == segments[row, start - 1] + 1
            assert batch["labels"][row, start - 1] == IGNORED_LABEL  # no label crosses into the next
        assert len(starts) >= 2  # 128 tokens hold more than one short conversation


def test_without_document_masking_the_rows_run_on(corpus):
    built = build_data(chat_config(corpus, document_masking=False))
    batch = next(built.train_batches(BATCH))
    assert set(batch) == {"input_ids", "labels"}
    masked = build_data(chat_config(corpus))
    assert torch.equal(next(masked.train_batches(BATCH))["input_ids"], batch["input_ids"])


def test_a_resume_continues_exactly(data):
    uninterrupted = data.train_batches(BATCH)
    expected = [next(uninterrupted) for _ in range(7)]
    first = data.train_batches(BATCH)
    for _ in range(4):
        next(first)
    resumed = data.train_batches(BATCH)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint stores it
    for batch in expected[4:]:
        again = next(resumed)
        assert all(torch.equal(batch[key], again[key]) for key in batch)


def test_held_out_conversations_are_evaluated(data):
    (batch,) = data.val_batches(BATCH, max_batches=1)
    assert (batch["labels"] != IGNORED_LABEL).any() and "segment_ids" in batch


def test_parquet_rows_give_the_same_batches(corpus, tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    rows = [json.loads(line)["messages"] for line in (corpus / "chat.jsonl").read_text().splitlines()]
    parquet.write_table(pyarrow.table({"messages": rows}), tmp_path / "chat.parquet", row_group_size=40)
    from_parquet = build_data(chat_config(corpus, source=ChatSourceConfig(paths=[str(tmp_path / "chat.parquet")])))
    from_jsonl = build_data(chat_config(corpus))
    # One stream each: the row order is the same (the parts differ: byte ranges vs row groups).
    one, other = from_parquet.train_batches(2, 0, 1), from_jsonl.train_batches(2, 0, 1)
    assert from_parquet.tokenizer.vocab_size == from_jsonl.tokenizer.vocab_size
    assert np.array_equal(next(one)["input_ids"][0][:8], next(other)["input_ids"][0][:8])


def test_rows_that_are_not_conversations_are_named(corpus, tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    built = build_data(chat_config(corpus, source=ChatSourceConfig(paths=[str(tmp_path / "bad.jsonl")])))
    with pytest.raises(ValueError, match=r"bad.jsonl:1: messages\[0\] \(user\) has no string 'content'"):
        next(built.train_batches(2, 0, 1))


def test_a_tokenizer_without_a_template_is_a_config_error(corpus, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((corpus / "tokenizer.json").read_bytes())
    tokenizer = TokenizerConfig(path=str(tmp_path / "tokenizer.json"), eos_token="<|im_end|>")
    config = chat_config(corpus, tokenizer=tokenizer)
    with pytest.raises(ConfigError, match=r"data\.source\.template"):
        next(build_data(config).train_batches(2, 0, 1))
    (tmp_path / "chatml.jinja").write_text(CHATML)
    config.source.template = str(tmp_path / "chatml.jinja")
    assert (next(build_data(config).train_batches(2, 0, 1))["labels"] != IGNORED_LABEL).any()


def test_data_chat_composes_with_document_masking():
    config = load_experiment_config(["data=chat", "data.source.paths=[chat.jsonl]"])
    assert isinstance(config.data.source, ChatSourceConfig) and config.data.document_masking
    assert config.data.source.paths == ["chat.jsonl"]


def test_jsonl_and_parquet_together_are_refused(corpus, tmp_path):
    (tmp_path / "rows.parquet").write_bytes(b"")
    source = ChatSourceConfig(paths=[str(corpus / "chat.jsonl"), str(tmp_path / "rows.parquet")])
    with pytest.raises(ConfigError, match="files of one format"):
        source.build()


def test_rows_without_messages_name_the_messages_field(corpus, tmp_path):
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "no messages here"}) + "\n")
    built = build_data(chat_config(corpus, source=ChatSourceConfig(paths=[str(tmp_path / "text.jsonl")])))
    with pytest.raises(ValueError, match=r"no field 'messages' \(data\.source\.messages_field\)"):
        next(built.train_batches(2, 0, 1))
