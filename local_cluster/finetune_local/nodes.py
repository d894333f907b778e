"""The kubelet's Node objects: one per virtual node, registered Ready on start."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from finetune_local.podstatus import now
from finetune_local.restclient import ApiStatusError, RestClient, resource_path


async def register_node(
    client: RestClient, name: str, labels: Mapping[str, str], capacity: Mapping[str, str]
) -> None:
    """Create the Node (if absent) and post its status as Ready, as a kubelet does on start."""
    body = {
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                **labels,
            },
        },
        "spec": {},
    }
    with contextlib.suppress(ApiStatusError):
        await client.create(resource_path("v1", "nodes"), body)
    status = {
        "capacity": dict(capacity),
        "allocatable": dict(capacity),
        "addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": name},
        ],
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "local kubelet is posting ready status",
                "lastHeartbeatTime": now(),
                "lastTransitionTime": now(),
            }
        ],
        "nodeInfo": {
            "kubeletVersion": "v1.32.0-local",
            "operatingSystem": "linux",
            "architecture": "amd64",
            "containerRuntimeVersion": "local://process",
        },
    }
    await client.merge_patch(
        resource_path("v1", "nodes", name=name, subresource="status"), {"status": status}
    )
