"""The Kubernetes manifests against their operators' published APIs, and their counts against each other:
torchrun's node and process counts and the mesh follow from the replicas and the accelerators asked for."""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_schemas import load_schema
from torch.distributed.run import get_args_parser

from axtorch.compose.experiment_loader import load_experiment_config

MANIFESTS = Path(__file__).parents[2] / "launch" / "kubernetes"


@pytest.fixture(scope="module")
def schemas() -> dict[str, Any]:
    """The operators' schemas, kept in the repository (tests/launch/k8s_schemas.py rebuilds them)."""
    return {kind: load_schema(kind) for kind in ("PyTorchJob", "JobSet")}


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((MANIFESTS / name).read_text())


def _errors(schema: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """Each violation where it happens: optional fields are ``anyOf [type, null]``, so a violation
    inside one shows up as the branches' errors, of which the ``null`` branch's says nothing."""
    import jsonschema

    def leaves(error: Any) -> Any:
        if not error.context:
            yield error
        for inner in error.context:
            if inner.validator_value != "null":
                yield from leaves(inner)

    validator = jsonschema.Draft202012Validator(schema)
    found = (leaf for error in validator.iter_errors(manifest) for leaf in leaves(error))
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message[:300]}" for error in found]


@pytest.mark.parametrize(("name", "kind"), [("pytorchjob.yaml", "PyTorchJob"), ("jobset.yaml", "JobSet")])
def test_manifest_follows_its_operators_schema(schemas, name, kind):
    manifest = _load(name)
    assert manifest["kind"] == kind
    assert _errors(schemas[kind], manifest) == []


def test_the_schemas_reject_a_misspelt_field_and_a_wrong_type(schemas):
    """Without these the validation above could pass anything."""
    manifest = _load("pytorchjob.yaml")
    pod = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds")
    manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "one"
    errors = _errors(schemas["PyTorchJob"], manifest)
    assert any("terminationGracePeriodSecond'" in error for error in errors), errors
    assert any("'one' is not of type 'integer'" in error for error in errors), errors
    jobset = _load("jobset.yaml")
    del jobset["spec"]["replicatedJobs"][0]["name"]
    assert any("'name' is a required property" in error for error in _errors(schemas["JobSet"], jobset))


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {variable["name"]: variable["value"] for variable in container.get("env", [])}


def test_pytorchjob_torchrun_counts_and_mesh_follow_the_replicas_and_gpus():
    manifest = _load("pytorchjob.yaml")
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    nodes = sum(spec["replicas"] for spec in replicas.values())
    for spec in replicas.values():
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
        env = _env(container)
        # The command as the pod's shell runs it, with the operator's MASTER_ADDR and MASTER_PORT.
        shell = container["command"][-1]
        for name, value in {**env, "MASTER_ADDR": "master", "MASTER_PORT": "23456"}.items():
            shell = shell.replace(f'"${name}"', value).replace(f"${name}", value)
        words = shlex.split(shell)
        assert words[:2] == ["exec", "torchrun"], words
        args = get_args_parser().parse_args(words[2:])  # torchrun's own parser: a misspelt flag fails here
        assert (int(args.nnodes), args.nproc_per_node) == (nodes, str(gpus))
        assert int(env["OMP_NUM_THREADS"]) >= 1
        # torchrun waits for its workers' save inside the grace period, both beyond the 30 s defaults.
        assert 30 < int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < pod["terminationGracePeriodSeconds"]
        assert args.module and args.training_script == "axtorch.train"
        config = load_experiment_config(args.training_script_args)
        assert math.prod(config.mesh.resolve(nodes * gpus).values()) == nodes * gpus
        assert config.backend.name == "native" and "sharding=fsdp" in args.training_script_args


def test_jobset_hosts_and_chips_fill_the_tpu_topology_and_the_mesh():
    manifest = _load("jobset.yaml")
    (replicated,) = manifest["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    hosts = job["parallelism"]
    assert job["completions"] == hosts and job["completionMode"] == "Indexed"
    chips = container["resources"]["limits"]["google.com/tpu"]
    topology = pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
    assert hosts * chips == math.prod(int(size) for size in topology.split("x"))
    assert pod["terminationGracePeriodSeconds"] > 30
    assert _env(container)["PJRT_DEVICE"] == "TPU"
    assert container["command"][:3] == ["python", "-m", "axtorch.train"]
    devices = replicated["replicas"] * hosts * chips
    config = load_experiment_config(container["command"][3:])
    assert math.prod(config.mesh.resolve(devices).values()) == devices
    assert config.backend.name == "xla" and "sharding=fsdp" in container["command"]
