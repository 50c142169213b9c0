"""``init_from=hf:DIR`` starts training from imported weights and their tokenizer."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.interop import from_hf
from axtorch.train.trained_model import load_trained_model
from axtorch.train.trainer import Trainer


@pytest.fixture
def hf_dir(tmp_path):
    """A random HF Llama shaped like the llama_debug preset, with a byte-level BPE tokenizer."""
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    directory = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    _save_tokenizer(directory)
    return directory


def _save_tokenizer(directory):
    """A byte-level BPE tokenizer.json, as HF model directories carry."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["def main():\n    return 0\n"] * 50, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))


def _config(tmp_path, hf_dir, data_cache, *extra):
    return load_experiment_config(
        [
            "experiment=debug",
            f"run_dir={tmp_path / 'run'}",
            f"data.cache_dir={data_cache}",
            "trainer.progress_bar=false",
            "trainer.device=cpu",  # compared with models built on the CPU
            f"init_from=hf:{hf_dir}",
            *extra,
        ]
    )


def test_training_starts_from_the_imported_weights_and_tokenizer(tmp_path, hf_dir, data_cache):
    trainer = Trainer(_config(tmp_path, hf_dir, data_cache))
    imported, _ = from_hf(hf_dir)
    expected = imported.state_dict()
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert trainer.data.tokenizer.vocab_size == Tokenizer.from_file(str(hf_dir / "tokenizer.json")).get_vocab_size()
    assert trainer.fit(until_step=2).step == 2
    resumed = Trainer(_config(tmp_path, hf_dir, data_cache))  # weights come from the checkpoint now
    assert resumed.pretrained is None
    assert resumed.fit(until_step=3).step == 3


def test_the_directorys_bos_and_end_of_turn_reach_the_data_and_the_runs_tokenizer(tmp_path, hf_dir, data_cache):
    """tokenizer_config.json's add_bos_token/bos_token start every document; the run directory keeps
    them, and generation_config.json's eos_token_id list, for generate and export."""
    settings = {"add_bos_token": True, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(settings))
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    trainer = Trainer(_config(tmp_path, hf_dir, data_cache))
    data_tokenizer = trainer.data.tokenizer
    assert data_tokenizer.document_ids(["x"]) == [[0, *data_tokenizer.encode("x"), 0]]
    assert data_tokenizer.stop_ids == (0, 5)
    assert trainer.fit(until_step=1).step == 1
    _, tokenizer = load_trained_model(tmp_path / "run", torch.device("cpu"))
    assert (tokenizer.bos_id, tokenizer.stop_ids) == (0, (0, 5))


def test_a_model_config_that_differs_from_the_weights_is_refused(tmp_path, hf_dir, data_cache):
    with pytest.raises(ConfigError, match=r"model\.dim=128 vs 64"):
        Trainer(_config(tmp_path, hf_dir, data_cache, "model.dim=128"))


def test_gpt2_training_starts_from_the_imported_weights(tmp_path, data_cache):
    """A GPT-2 directory shaped like the gpt2_tiny preset: Conv1D, fused q/k/v and position table included."""
    config = transformers.GPT2Config(
        vocab_size=4096,
        n_embd=192,
        n_layer=4,
        n_head=6,
        n_positions=1024,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
    )
    torch.manual_seed(0)
    directory = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    _save_tokenizer(directory)

    trainer = Trainer(_config(tmp_path, directory, data_cache, "model=gpt2_tiny"))

    expected = from_hf(directory)[0].state_dict()
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert trainer.fit(until_step=2).step == 2
