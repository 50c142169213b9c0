"""Hostile or broken input gets a clear message, and no load path runs code it was handed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.config.serialize import config_from_yaml, config_to_yaml
from axtorch.data.packing import prepare_corpus
from axtorch.train.checkpoint import Checkpointer
from axtorch.train.checkpoint_manifest import CheckpointError
from axtorch.train.experiment import ExperimentConfig
from axtorch.train.optimizer import build_optimizer
from axtorch.train.trainer import Trainer

PACKAGE = Path(__file__).resolve().parents[2] / "axtorch"


def _corpus_config(tmp_path: Path, *extra: str) -> ExperimentConfig:
    return load_experiment_config(
        [
            "model=llama_debug",
            "data=text_files",
            f"data.source.paths=[{tmp_path / 'corpus'}/*.txt]",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"run_dir={tmp_path / 'run'}",
            "trainer.progress_bar=false",
            "trainer.plot=false",
            "trainer.max_steps=1",
            "trainer.batch_size=2",
            "trainer.eval_batches=1",
            "data.seq_len=16",
            "data.tokenizer.vocab_size=300",
            "model.vocab_size=512",
            *extra,
        ]
    )


def test_a_corpus_of_empty_files_is_named_as_such(tmp_path):
    (tmp_path / "corpus").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "corpus" / name).write_text("")
    with pytest.raises(ConfigError, match=r"data.source.*its 2 document\(s\) are empty"):
        Trainer(_corpus_config(tmp_path))


def test_non_utf8_bytes_are_replaced_not_fatal(tmp_path):
    """Each invalid byte sequence becomes U+FFFD in the text the tokenizer sees; the rest is kept."""
    (tmp_path / "corpus").mkdir()
    text = ("plain words and some more words to fill a few sequences. " * 30).encode()
    (tmp_path / "corpus" / "mixed.txt").write_bytes(b"\xff\xfe\x80 broken " + text + b"\xc3\x28 end")
    config = _corpus_config(tmp_path, "data.val_fraction=0.1")
    assert Trainer(config).fit().step == 1
    corpus = prepare_corpus(config.data)  # the cache entry the run trained on
    seen = corpus.tokenizer.decode([*corpus.train_tokens, *corpus.val_tokens])
    assert seen.startswith("\ufffd\ufffd\ufffd broken plain words")
    assert seen.endswith("sequences. \ufffd( end" + corpus.tokenizer.eos_token)


def test_a_document_longer_than_the_sequence_spans_several_sequences(tmp_path):
    """One long document (no EOS inside) is packed across sequences, none of its tokens dropped."""
    (tmp_path / "corpus").mkdir()
    words = " ".join(f"word{i % 97}" for i in range(3000))
    (tmp_path / "corpus" / "long.txt").write_text(words)
    trainer = Trainer(_corpus_config(tmp_path, "data.val_fraction=0.1"))
    tokens = len(trainer.data.tokenizer.encode(words))
    assert tokens > 20 * 16  # many sequences long
    assert trainer.data.train_num_sequences + trainer.data.val_num_sequences >= tokens // 16 - 2
    assert trainer.fit().step == 1


def test_a_tokenizer_vocabulary_larger_than_the_model_is_named(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("plain words and some more words to fill sequences. " * 40)
    with pytest.raises(ConfigError) as error:
        Trainer(_corpus_config(tmp_path, "data.val_fraction=0.1", "model.vocab_size=280"))
    assert error.value.key == "model.vocab_size"
    assert "at least the tokenizer's" in str(error.value) and "280" in str(error.value)


def test_a_checkpoint_of_another_shape_lists_every_mismatched_tensor(tmp_path):
    narrow = load_experiment_config(["model=llama_debug"])
    wide = load_experiment_config(["model=llama_debug", "model.dim=96", "model.decoder.layer.attention.num_heads=4"])
    saved = narrow.model.build()
    path = Checkpointer(tmp_path, keep=1).save(1, saved, build_optimizer(saved, narrow.optim), {})
    target = wide.model.build()
    with pytest.raises(CheckpointError) as info:
        Checkpointer(tmp_path, keep=1).load(path, target, None)
    differing = [n for n, p in target.state_dict().items() if p.shape != saved.state_dict()[n].shape]
    message = str(info.value)
    assert f"{len(differing)} of another shape" in message
    old, new = tuple(saved.embedding.weight.shape), tuple(target.embedding.weight.shape)
    assert f"embedding.weight {old} vs {new}" in message


def test_a_stored_config_cannot_name_code_outside_axtorch(tmp_path):
    text = config_to_yaml(load_experiment_config(["experiment=debug"]))
    for target in ("os.system", "subprocess.Popen", "builtins.eval", "axtorch.train.trainer.Trainer"):
        hostile = text.replace("_type_: axtorch.layers.feed_forward.GatedFeedForwardConfig", f"_type_: {target}", 1)
        assert hostile != text
        with pytest.raises(ValueError, match="is not an axtorch config class"):
            config_from_yaml(hostile, ExperimentConfig)


def test_nothing_in_axtorch_unpickles():
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if re.search(r"\bpickle\b|torch\.load\(|weights_only\s*=\s*False|numpy\.load\(.*allow_pickle=True", line)
    ]
    assert not offenders, offenders
