"""The Kubernetes manifests against their operators' published APIs, and their counts against each other:
torchrun's node and process counts and the mesh follow from the replicas and the accelerators asked for."""

from __future__ import annotations

import math
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_schemas import load_schema
from torch.distributed.run import get_args_parser

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.train.exit_codes import ExitCode

REPO = Path(__file__).parents[2]
MANIFESTS = REPO / "launch" / "kubernetes"


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
        # The wrapper that gives the pod axtorch's exit codes (test_pytorchjob_restarts_...).
        assert words[:3] == ["exec", "launch/preemptible.sh", "torchrun"], words
        assert (REPO / words[1]).is_file()
        args = get_args_parser().parse_args(words[3:])  # torchrun's own parser: a misspelt flag fails here
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


# What each scheduler does with a pod's exit code, as its operator documents it, applied to the
# manifest's own policies. A pod's code is axtorch's (docs/training.md, "Exit codes"): the
# JobSet's hosts run the trainer as their first process; the PyTorchJob's pods run torchrun under
# launch/preemptible.sh, which exits 203 for a preempted run and 1 when torchrun gave up on its
# workers, whatever their own codes (tests/train/test_preemption.py runs that wrapper).
KILLED = 137  # SIGKILL: the grace period ran out, or the OOM killer
RESTART_UNCOUNTED = "restart, not counted as a failure"
RESTART_COUNTED = "restart, counted against the failure budget"
FAILED = "job failed"
DONE = "job succeeded"


def _pytorchjob_action(restart_policy: str, code: int) -> str:
    """Kubeflow training operator v1 (kubeflow.org/v1 PyTorchJob): ``ExitCode`` treats 1-127 as
    permanent errors and 128-255 as retryable, and restarts the pod without counting it against
    ``backoffLimit``; ``OnFailure`` restarts any failure, counting it; ``Never`` restarts none."""
    if code == 0:
        return DONE
    if restart_policy == "ExitCode":
        return RESTART_UNCOUNTED if code >= 128 else FAILED
    return {"OnFailure": RESTART_COUNTED, "Never": FAILED}[restart_policy]


def _job_failure_reason(job: dict[str, Any], code: int, conditions: tuple[str, ...]) -> str:
    """batch/v1 Job with backoffLimit 0: the first podFailurePolicy rule that matches acts (FailJob
    fails the Job with reason PodFailurePolicy, Ignore recreates the pod uncounted); otherwise the
    failure counts, and past backoffLimit the Job fails with reason BackoffLimitExceeded."""
    for rule in job.get("podFailurePolicy", {}).get("rules", []):
        codes = rule.get("onExitCodes")
        matches = bool(codes) and (code in codes["values"]) == (codes["operator"] == "In")
        matches |= any(pattern["type"] in conditions for pattern in rule.get("onPodConditions", []))
        if matches:
            return {"FailJob": "PodFailurePolicy", "Ignore": "ignored"}[rule["action"]]
    assert job["backoffLimit"] == 0
    return "BackoffLimitExceeded"


def _jobset_action(manifest: dict[str, Any], code: int, conditions: tuple[str, ...] = ()) -> str:
    """JobSet v1alpha2: a failed Job is matched against failurePolicy.rules in order (an empty
    onJobFailureReasons matches any reason); with no match the action is RestartJobSet, counted
    against maxRestarts."""
    if code == 0 and not conditions:
        return DONE
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    reason = _job_failure_reason(job, code, conditions)
    policy = manifest["spec"]["failurePolicy"]
    action = next(
        (r["action"] for r in policy.get("rules", []) if reason in r.get("onJobFailureReasons", [reason])),
        "RestartJobSet",
    )
    return {
        "RestartJobSetAndIgnoreMaxRestarts": RESTART_UNCOUNTED,
        "RestartJobSet": RESTART_COUNTED,
        "FailJobSet": FAILED,
    }[action]


def test_pytorchjob_restarts_a_preempted_pod_uncounted_and_fails_on_a_real_failure():
    replicas = _load("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]
    expected = {
        ExitCode.FINISHED: DONE,
        ExitCode.FAILED: FAILED,  # torchrun's in-place restarts (--max-restarts) are spent
        KILLED: RESTART_UNCOUNTED,  # the kubelet's SIGKILL, or the OOM killer
        ExitCode.PREEMPTED: RESTART_UNCOUNTED,
    }
    for name, spec in replicas.items():
        got = {code: _pytorchjob_action(spec["restartPolicy"], int(code)) for code in expected}
        assert got == expected, name


@pytest.mark.journey
def test_a_preempted_pytorchjob_pod_exits_with_a_code_its_restart_policy_restarts_uncounted(tmp_path):
    """Each pod's own command, its torchrun a stand-in preempted as the real one is: the workers
    saved and wrote 203 where the launcher asked, and torchrun exits 1 itself. Run as ``exec
    torchrun`` alone, the pod exited with torchrun's status: the job failed, or ended at exit 0."""
    torchrun = tmp_path / "torchrun"
    torchrun.write_text('#!/bin/sh\n[ -z "$AXTORCH_STATUS_FILE" ] || echo 203 >"$AXTORCH_STATUS_FILE"\nexit 1\n')
    torchrun.chmod(0o755)
    for name, spec in _load("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"].items():
        (container,) = spec["template"]["spec"]["containers"]
        path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
        env = {**os.environ, **_env(container), "MASTER_ADDR": "master", "MASTER_PORT": "23456", "PATH": path}
        pod = subprocess.run(container["command"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        action = _pytorchjob_action(spec["restartPolicy"], pod.returncode)
        assert action == RESTART_UNCOUNTED, (name, pod.returncode, pod.stderr)


def test_jobset_restarts_a_preempted_slice_uncounted_and_counts_every_other_failure():
    manifest = _load("jobset.yaml")
    expected = {
        ExitCode.FINISHED: DONE,
        ExitCode.FAILED: RESTART_COUNTED,
        ExitCode.CONFIG_ERROR: RESTART_COUNTED,
        ExitCode.NON_FINITE: RESTART_COUNTED,
        ExitCode.HUNG: RESTART_COUNTED,
        KILLED: RESTART_COUNTED,
        ExitCode.PREEMPTED: RESTART_UNCOUNTED,
    }
    assert {code: _jobset_action(manifest, int(code)) for code in expected} == expected
    # A host evicted before it could save: the slice restarts uncounted, from the newest checkpoint.
    assert _jobset_action(manifest, KILLED, conditions=("DisruptionTarget",)) == RESTART_UNCOUNTED
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # what podFailurePolicy requires
    (container,) = pod["containers"]
    rules = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    assert all(rule["onExitCodes"]["containerName"] == container["name"] for rule in rules if "onExitCodes" in rule)
