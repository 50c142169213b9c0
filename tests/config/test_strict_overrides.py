"""Every unknown key is an error, whether or not it carries Hydra's ``+``, ``++`` or ``~``."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from axtorch.compose.experiment_loader import compose_experiment_config, load_experiment_config
from axtorch.config.errors import ConfigError

#: Real paths of the composed default experiment, under which an unknown key is planted.
PARENTS = [
    "",
    "trainer",
    "optim",
    "optim.schedule",
    "data",
    "data.source",
    "data.tokenizer",
    "model",
    "model.decoder",
    "model.decoder.layer.attention",
    "model.decoder.layer.feed_forward",
    "mesh",
]


def _existing_keys(parent: str) -> set[str]:
    node = compose_experiment_config([])
    for part in filter(None, parent.split(".")):
        node = node[part]
    return set(node.keys())


EXISTING = {parent: _existing_keys(parent) for parent in PARENTS}
names = st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parent=st.sampled_from(PARENTS),
    name=names,
    prefix=st.sampled_from(["", "+", "++", "~"]),
    value=st.sampled_from(["3", "true", "x", "[1,2]"]),
)
def test_an_unknown_key_is_refused_with_any_prefix(parent, name, prefix, value):
    if name in EXISTING[parent]:
        return
    key = f"{parent}.{name}" if parent else name
    override = f"{prefix}{key}" if prefix == "~" else f"{prefix}{key}={value}"
    with pytest.raises(ConfigError) as info:
        load_experiment_config([override])
    assert info.value.key == key
    assert f"no key {name!r}" in str(info.value)


def test_the_closest_valid_key_is_suggested_for_an_added_key():
    with pytest.raises(ConfigError, match=r"did you mean trainer\.max_steps"):
        load_experiment_config(["+trainer.max_stepz=3"])


def test_prefixes_still_work_for_what_hydra_allows():
    assert load_experiment_config(["++trainer.max_steps=7"]).trainer.max_steps == 7


@pytest.mark.journey
def test_the_command_line_refuses_an_added_unknown_key(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "axtorch.train", "+trainer.no_such_key=3", f"run_dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 2
    assert "trainer.no_such_key" in result.stderr and "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_a_key_whose_value_is_still_missing_can_be_set():
    """``model/mask=sliding_window`` leaves ``window`` as ``???``: setting it is not an unknown key."""
    config = load_experiment_config(["model/mask=sliding_window", "model.decoder.layer.attention.mask.window=256"])
    assert config.model.decoder.layer.attention.mask.window == 256


def test_an_unparsable_override_names_itself_and_the_quoting_that_fixes_it():
    with pytest.raises(ConfigError) as info:
        load_experiment_config(["data=text_files", "data.source.paths=[~/corpus/*.txt]"])
    assert info.value.key == "data.source.paths"
    assert "cannot parse 'data.source.paths=[~/corpus/*.txt]'" in str(info.value)
    assert '"~/corpus/**/*.txt"' in info.value.allowed


def test_an_experiment_s_corpus_can_be_swapped_for_another_source():
    """``experiment=debug`` picks a small corpus as a data option, so ``data=jsonl`` replaces it
    instead of meeting a ``max_files`` the JSONL source does not have."""
    config = load_experiment_config(["experiment=debug", "data=jsonl", "data.source.paths=[x.jsonl]"])
    assert config.data.source.paths == ["x.jsonl"] and config.data.seq_len == 64
    assert load_experiment_config(["experiment=debug"]).data.source.max_files == 80
