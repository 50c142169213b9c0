"""Config classes whose module was renamed: configs and checkpoints written under the old name still load."""

import json

import pytest

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.serialize import MOVED_MODULES, config_from_yaml, config_to_yaml, with_former_module_names
from axtorch.train.checkpoint import TRAINER_STATE_FILE, list_checkpoints
from axtorch.train.checkpoint_manifest import MANIFEST_FILE, file_record
from axtorch.train.experiment import ExperimentConfig
from axtorch.train.trainer import Trainer, config_digest


def _config(run_dir, data_cache, max_steps):
    return load_experiment_config(
        [
            "experiment=debug",
            f"run_dir={run_dir}",
            f"data.cache_dir={data_cache}",
            "trainer.progress_bar=false",
            f"trainer.max_steps={max_steps}",
        ]
    )


def test_a_type_under_a_former_module_name_reads_with_a_warning_naming_the_new_one(tmp_path, data_cache):
    config = _config(tmp_path, data_cache, 1)
    text = config_to_yaml(config)
    former = with_former_module_names(text)
    assert "_type_: axtorch.layers.position.RotaryEmbeddingConfig" in former
    with pytest.warns(FutureWarning, match="renamed to 'axtorch.layers.relative_position'"):
        assert config_from_yaml(former, ExperimentConfig) == config


def test_every_former_module_is_gone_and_its_successor_exists():
    import importlib

    for old, new in MOVED_MODULES.items():
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
        importlib.import_module(new)


def test_a_checkpoint_saved_before_the_rename_resumes(tmp_path, data_cache):
    run = tmp_path / "run"
    Trainer(_config(run, data_cache, 2)).fit()
    # Make the run look as it did before the rename: the config file and the recorded model digest.
    (run / "config.yaml").write_text(with_former_module_names((run / "config.yaml").read_text()))
    (checkpoint,) = list_checkpoints(run / "checkpoints")
    state_file = checkpoint / TRAINER_STATE_FILE
    state = json.loads(state_file.read_text())
    model_text = config_to_yaml(_config(run, data_cache, 2).model)
    assert state["model_config_digest"] == config_digest(model_text)
    state["model_config_digest"] = config_digest(with_former_module_names(model_text))
    assert state["model_config_digest"] != config_digest(model_text)  # the rename changed the text
    state_file.write_text(json.dumps(state, indent=2))
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    manifest["files"][TRAINER_STATE_FILE] = file_record(state_file)
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))

    resumed = Trainer(_config(run, data_cache, 4)).fit()
    assert resumed.step == 4
