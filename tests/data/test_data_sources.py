"""Document sources: order, globbing, fingerprints and the errors a user sees for bad input."""

import json
import os
import sysconfig
from pathlib import Path

import pytest

from axtorch.config.errors import ConfigError
from axtorch.data import (
    HFDatasetSourceConfig,
    JsonlSourceConfig,
    PythonStdlibSourceConfig,
    TextFilesSourceConfig,
)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_text_files_are_sorted_deduplicated_documents(tmp_path):
    write(tmp_path / "b.txt", "second")
    write(tmp_path / "a" / "deep" / "c.txt", "first")
    write(tmp_path / "notes.md", "ignored")
    patterns = [str(tmp_path / "**" / "*.txt"), str(tmp_path / "b.txt")]
    source = TextFilesSourceConfig(paths=patterns).build()
    assert list(source.iter_documents()) == ["first", "second"]


def test_text_files_expand_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path / "corpus" / "x.txt", "from home")
    source = TextFilesSourceConfig(paths=["~/corpus/*.txt"]).build()
    assert list(source.iter_documents()) == ["from home"]


def test_glob_matching_nothing_is_a_config_error(tmp_path):
    write(tmp_path / "a.txt", "text")
    with pytest.raises(ConfigError) as error:
        TextFilesSourceConfig(paths=[str(tmp_path / "a.txt"), str(tmp_path / "*.nope")]).build()
    assert error.value.key == "data.source.paths"
    assert "*.nope" in str(error.value)


def test_file_fingerprint_is_stable_and_tracks_edits(tmp_path):
    path = write(tmp_path / "a.txt", "one")
    config = TextFilesSourceConfig(paths=[str(path)])
    before = config.build().fingerprint()
    assert config.build().fingerprint() == before
    write(path, "one more")
    assert config.build().fingerprint() != before


def test_jsonl_yields_one_document_per_line(tmp_path):
    write(tmp_path / "1.jsonl", '{"body": "a", "id": 1}\n\n{"body": "b"}\n')
    write(tmp_path / "2.jsonl", json.dumps({"body": "héllo"}) + "\n")
    source = JsonlSourceConfig(paths=[str(tmp_path / "*.jsonl")], text_field="body").build()
    assert list(source.iter_documents()) == ["a", "b", "héllo"]
    other_field = JsonlSourceConfig(paths=[str(tmp_path / "*.jsonl")], text_field="text").build()
    assert other_field.fingerprint() != source.fingerprint()


def test_jsonl_missing_field_names_file_line_and_field(tmp_path):
    path = write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{"content": "no text"}\n')
    source = JsonlSourceConfig(paths=[str(path)]).build()
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no field 'text'"):
        list(source.iter_documents())


def test_stdlib_source_skips_tests_and_site_packages():
    source = PythonStdlibSourceConfig(max_files=120).build()
    documents = list(source.iter_documents())
    assert len(documents) == 120
    assert all(isinstance(text, str) for text in documents)
    root = Path(sysconfig.get_paths()["stdlib"])
    everything = PythonStdlibSourceConfig().build().files
    assert len(everything) > 100
    assert everything == sorted(everything, key=str)
    excluded = {"site-packages", "test", "tests", "idlelib"}
    assert not any(excluded & set(path.relative_to(root).parts[:-1]) for path in everything)
    assert root / "os.py" in everything


def test_stdlib_max_files_must_be_positive():
    with pytest.raises(ConfigError) as error:
        PythonStdlibSourceConfig(max_files=0).build()
    assert error.value.key == "data.source.max_files"


def test_hf_dataset_reads_a_local_json_file(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    path = write(tmp_path / "rows.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in ["x", "y", "z"]))
    config = HFDatasetSourceConfig(path="json", data_files=[str(path)])
    source = config.build()
    assert list(source.iter_documents()) == ["x", "y", "z"]
    assert config.build().fingerprint() == source.fingerprint()
    wrong_field = HFDatasetSourceConfig(path="json", data_files=[str(path)], text_field="body").build()
    with pytest.raises(ConfigError) as error:
        list(wrong_field.iter_documents())
    assert error.value.key == "data.source.text_field"


def test_hf_dataset_without_datasets_says_how_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    source = HFDatasetSourceConfig(path="json", data_files=[os.devnull]).build()
    with pytest.raises(ImportError, match="pip install datasets"):
        next(source.iter_documents())
