"""Why a worker pod fits no node, in the job's terms: which of its requests the scheduler found
no room for, how much the pod asks, and which field of the FineTuneJob sets it (pure).

kube-scheduler says ``0/4 nodes are available: 4 Insufficient ephemeral-storage.`` (a
``preemption: ...`` tail may follow): true, but the user wrote ``dataset.cacheSizeLimit``, not
an ephemeral-storage request. This names the request and the field, so the job's status says
what to change: the field, or the nodes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# The spec field behind each request of a worker pod (resources/worker.py:worker_resources).
REQUEST_FIELDS = {
    "cpu": "spec.resources.cpu",
    "memory": "spec.resources.memory",
    "ephemeral-storage": "spec.dataset.cacheSizeLimit",
}
# Any other resource a worker requests is its accelerator.
ACCELERATOR_FIELD = "spec.resources.gpusPerNode"

# "<count> Insufficient <resource>" in the scheduler's histogram: a resource name is a DNS
# subdomain prefix and a name (nvidia.com/gpu), so it stops at the separator after it.
_INSUFFICIENT = re.compile(r"\b\d+ Insufficient ([A-Za-z0-9./_-]*[A-Za-z0-9])")


def worker_requests(spec: Mapping[str, Any]) -> dict[str, str]:
    """What a pod's containers request, as written (the first container's value of each)."""
    requests: dict[str, str] = {}
    for container in spec.get("containers") or []:
        for name, value in (((container.get("resources") or {}).get("requests")) or {}).items():
            requests.setdefault(str(name), str(value))
    return requests


def short_resources(message: str) -> list[str]:
    """The resources the scheduler's message says no node had room for, in its order, once
    each (``preemption: ...`` repeats none: it counts nodes, not resources)."""
    seen: list[str] = []
    for name in _INSUFFICIENT.findall(message):
        if name not in seen:
            seen.append(name)
    return seen


def explain_unschedulable(message: str, requests: Mapping[str, str]) -> str | None:
    """What a user can act on, or None when the message names no resource request (a node
    selector that matches nothing, taints, ``Too many pods``: the scheduler's words say it)."""
    parts = []
    for name in short_resources(message):
        field = REQUEST_FIELDS.get(name, ACCELERATOR_FIELD)
        asked = f" {requests[name]}" if name in requests else ""
        parts.append(f"{name}{asked} ({field})")
    if not parts:
        return None
    return f"no node has room for the worker's {', '.join(parts)}: lower it or add node capacity"
