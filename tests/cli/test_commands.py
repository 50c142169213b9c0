"""Every command speaks one style: ``key=value`` checked against its config dataclass, ``--help`` generated
from it, ``python -m axtorch.<command>``, and the argparse-era arguments mapped for one release."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from axtorch.cli import ckpt, export, generate, golden, plan, plot, tokenize
from axtorch.cli.key_values import OldStyle, key_docs, modernize, parse_key_values
from axtorch.config.errors import ConfigError

#: command -> (its module, its config dataclass, a misspelt key=value, the key it should suggest)
COMMANDS = {
    "generate": (generate, generate.GenerateConfig, "sampling.temprature=0.5", "sampling.temperature"),
    "export": (export, export.ExportConfig, "checkpoit=runs/x", "checkpoint"),
    "plan": (plan, plan.PlanOptions, "bacth=2", "batch"),
    "tokenize": (tokenize, tokenize.TokenizeOptions, "workres=2", "workers"),
    "ckpt": (ckpt, ckpt.CkptConfig, "actoin=list", "action"),
    "golden": (golden, golden.GoldenConfig, "golden_dri=g", "golden_dir"),
    "plot": (plot, plot.PlotConfig, "metric=train/loss", "metrics"),
}
ALL = ("train", *COMMANDS)


@pytest.fixture(scope="module")
def module_helps() -> dict[str, str]:
    """``python -m axtorch.<command> --help`` of all eight, each as ``runpy`` runs it for ``-m``, in one process."""
    script = f"""
import contextlib, io, json, runpy, sys
helps = {{}}
for command in {list(ALL)!r}:
    sys.argv = ["axtorch." + command, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module("axtorch." + command, run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            assert exit.code in (0, None), (command, exit.code)
    helps[command] = out.getvalue()
print(json.dumps(helps))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.journey
@pytest.mark.parametrize("command", ALL)
def test_python_m_runs_every_command_and_its_help_lists_its_keys(module_helps, command):
    text = module_helps[command]
    if command == "train":  # Hydra's help: the config groups and every key of the composed config
        assert "== Configuration groups ==" in text and "max_steps:" in text
        return
    _, schema, _, _ = COMMANDS[command]
    for doc in key_docs(schema):
        assert f"  {doc.key}={doc.default}" in text, doc.key
        assert f"({doc.type})" in text


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_unknown_key_is_refused_with_the_nearest_one_and_the_allowed_keys(command, capsys):
    module, _, typo, meant = COMMANDS[command]
    assert module.main([typo]) == 2
    err = capsys.readouterr().err
    key = typo.partition("=")[0]
    assert f"axtorch-{command}:" in err and key in err
    assert f"did you mean {meant}?" in err
    assert repr(meant.rpartition(".")[2]) in err  # the allowed keys are listed


def test_help_shows_type_default_and_the_fields_comment(capsys):
    assert generate.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "max_new_tokens=64" in out and "(int) Tokens to decode after each prompt, at most." in out
    assert "sampling.top_k=null  " in out and "(int or null) Keep only the k most likely tokens" in out
    assert "chat=false" in out and "stop=[]" in out


def test_list_keys_take_comma_separated_items_or_a_bracketed_list():
    config = parse_key_values(["runs=runs/a,runs/b", "metrics=[train/loss]"], plot.PlotConfig)
    assert config.runs == ["runs/a", "runs/b"] and config.metrics == ["train/loss"]
    # A string key's value as written, not YAML: a colon makes no mapping, "yes" no boolean.
    assert parse_key_values(["title=Loss: runs", "out=yes"], plot.PlotConfig).title == "Loss: runs"
    assert parse_key_values(["out=yes"], plot.PlotConfig).out == "yes"
    assert parse_key_values(["out=null"], plot.PlotConfig).out is None
    with pytest.raises(ConfigError, match="log_y"):
        parse_key_values(["log_y=sometimes"], plot.PlotConfig)


def test_argparse_era_arguments_map_to_the_same_config_with_a_deprecation_note(capsys):
    old = ["runs/a", "runs/b", "--out", "a b.png", "--metrics", "train/loss", "eval/loss", "--log-y", "--title=T: x"]
    mapped = modernize("axtorch-plot", old, plot.PlotConfig, plot._OLD_STYLE)
    expected = plot.PlotConfig(["runs/a", "runs/b"], "a b.png", ["train/loss", "eval/loss"], "T: x", log_y=True)
    assert parse_key_values(mapped, plot.PlotConfig) == expected
    note = capsys.readouterr().err
    assert "deprecated" in note
    assert "write: axtorch-plot 'out=a b.png' log_y=true 'title=T: x' runs=runs/a,runs/b metrics=train/loss," in note
    # The note's command line, as a shell splits it, gives the same config.
    written = note.split("write: axtorch-plot ")[1].strip()
    assert parse_key_values(shlex.split(written), plot.PlotConfig) == expected
    assert modernize("axtorch-plot", ["runs=runs/a"], plot.PlotConfig, plot._OLD_STYLE) == ["runs=runs/a"]
    assert capsys.readouterr().err == ""  # key=value alone: no note


def test_config_dir_stays_a_flag_without_a_note_as_for_train(capsys):
    mapped = modernize(
        "axtorch-golden", ["action=write", "--config-dir", "conf"], golden.GoldenConfig, golden._OLD_STYLE
    )
    assert parse_key_values(mapped, golden.GoldenConfig).config_dirs == ["conf"]
    assert capsys.readouterr().err == ""


def test_an_argument_of_neither_style_names_the_keys():
    with pytest.raises(ConfigError, match=r"--verbose.*allowed: key=value items, keys: \['action', 'path'\]"):
        modernize("axtorch-ckpt", ["list", "runs/x", "--verbose"], ckpt.CkptConfig, ckpt._OLD_STYLE)
    with pytest.raises(ConfigError, match="invalid config extra=None"):  # more bare words than positional keys
        modernize("axtorch-ckpt", ["list", "runs/x", "extra"], ckpt.CkptConfig, ckpt._OLD_STYLE)
    with pytest.raises(ConfigError, match="invalid config runs/x=None"):
        modernize("axtorch-ckpt", ["list", "runs/x"], ckpt.CkptConfig, OldStyle(positional=("action",)))


def test_every_command_config_documents_every_key():
    for command, (_, schema, _, _) in COMMANDS.items():
        undocumented = [doc.key for doc in key_docs(schema) if not doc.doc]
        assert not undocumented, f"axtorch-{command}: no #: comment above {undocumented}"


@pytest.mark.parametrize(
    ("arguments", "allowed"),
    [
        (["decode.kernel=fastest"], "one of ['auto', 'linear', 'transposed', 'packed', 'native', 'native_float32']"),
        (["decode.kernel=packed", "compile=true"], "auto or linear with compile=true"),
    ],
)
def test_the_decode_kernel_is_auto_or_named_and_anything_else_is_refused_by_name(arguments, allowed, capsys):
    """Chosen by rule or by the user, never by timing (docs/inference.md); refused before any file is read."""
    assert generate.main(["checkpoint=no/such/run", "prompt=x", *arguments]) == 2
    error = capsys.readouterr().err
    assert "decode.kernel" in error and arguments[0].partition("=")[2] in error and allowed in error, error
