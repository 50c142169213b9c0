"""The planner: how a model splits over a mesh, what each device holds, and which mesh to train on.

``plan`` sizes one mesh (``axtorch-plan model=... mesh.fsdp=...``); ``Planner`` searches the meshes
of a cluster (``axtorch-plan hardware=...``) for the best estimated MFU. Both read the hardware
catalogue (``axtorch.parallel.chips``) and one per-device memory model (``memory``).
"""

from axtorch.plan.cluster import Cluster, cluster_for
from axtorch.plan.inputs import load_plan_inputs
from axtorch.plan.memory import DeviceMemory, activation_bytes, device_memory
from axtorch.plan.placement import ParameterGroup, Plan, plan
from axtorch.plan.report import format_candidates, format_plan
from axtorch.plan.search import Candidate, Planner

__all__ = [
    "Candidate",
    "Cluster",
    "DeviceMemory",
    "ParameterGroup",
    "Plan",
    "Planner",
    "activation_bytes",
    "cluster_for",
    "device_memory",
    "format_candidates",
    "format_plan",
    "load_plan_inputs",
    "plan",
]
