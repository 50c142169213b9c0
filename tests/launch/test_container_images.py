"""The container images the Kubernetes manifests name: each manifest's image is built from a
Dockerfile under launch/docker/, which hadolint passes and which holds what the manifest's command
needs where the command runs it. No image is built here (launch/kubernetes/README.md says why)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).parents[2]
DOCKERFILES = REPO / "launch" / "docker"
HADOLINT = Path(sys.executable).with_name("hadolint")


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comments dropped, continued lines joined."""
    text = re.sub(
        r"\\\n", " ", "\n".join(line for line in dockerfile.read_text().splitlines() if not line.startswith("#"))
    )
    return [(line.split()[0].upper(), line.split(maxsplit=1)[1]) for line in text.splitlines() if line.strip()]


def _container(manifest: dict) -> dict:
    """The training container: the PyTorchJob's Master pod's, the JobSet's hosts'."""
    if manifest["kind"] == "PyTorchJob":
        pod = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    else:
        pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return pod["containers"][0]


@pytest.mark.parametrize(
    ("manifest_name", "dockerfile_name", "extras"),
    [("pytorchjob.yaml", "gpu.Dockerfile", {"hf", "float8"}), ("jobset.yaml", "tpu.Dockerfile", {"xla", "hf"})],
)
def test_each_manifest_names_a_dockerfile_that_holds_what_its_command_runs(manifest_name, dockerfile_name, extras):
    manifest_path = REPO / "launch" / "kubernetes" / manifest_name
    assert f"launch/docker/{dockerfile_name}" in manifest_path.read_text()  # the image placeholder's comment
    container = _container(yaml.safe_load(manifest_path.read_text()))
    instructions = _instructions(DOCKERFILES / dockerfile_name)
    assert ("WORKDIR", container["workingDir"]) in instructions
    copied = {arguments.split()[0] for instruction, arguments in instructions if instruction == "COPY"}
    assert {"axtorch", "conf", "launch", "pyproject.toml"} <= copied
    command = " ".join(container["command"])
    for path in re.findall(r"\blaunch/\S+", command):  # e.g. launch/preemptible.sh, run from workingDir
        assert (REPO / path).is_file() and "launch" in copied, path
    (install,) = [shlex.split(arguments) for instruction, arguments in instructions if instruction == "RUN"]
    (local,) = [word for word in install if word.startswith(".[")]
    assert set(local[2:-1].split(",")) == extras


def test_hadolint_passes_the_dockerfiles_and_flags_a_bad_one(tmp_path):
    dockerfiles = sorted(DOCKERFILES.glob("*.Dockerfile"))
    assert [p.name for p in dockerfiles] == ["gpu.Dockerfile", "tpu.Dockerfile"]
    result = subprocess.run([str(HADOLINT), *map(str, dockerfiles)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install torch\n")
    result = subprocess.run([str(HADOLINT), str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "DL3007" in result.stdout and "DL3003" in result.stdout, result.stdout
