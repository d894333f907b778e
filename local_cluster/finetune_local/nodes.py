"""The kubelet's Node objects: one per virtual node, registered Ready on start, with the
capacity and allocatable the scheduler places pods against (:mod:`.resourcefit`), and its
heartbeats: the node's Lease in ``kube-node-lease`` renewed every few seconds (a kubelet
renews it every ``leaseDurationSeconds / 4``: 10 s), and the Ready condition posted again
when the API holds another (the node lifecycle controller set it Unknown while the node was
lost: :mod:`.nodelifecycle`).

A node's capacity is :data:`DEFAULT_CAPACITY` unless the cluster says otherwise
(``LocalCluster(node_capacity=..., node_resources={node: ...})``). Its allocatable is what a
kubelet with default flags reports: capacity less the hard-eviction thresholds it keeps back
(``memory.available<100Mi``, ``nodefs.available<10%``) and no system or kube reservation.
The figures are declared, not measured: the pods' processes share this machine whatever the
nodes advertise, and nothing enforces them but the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import platform
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import Any

from finetune_local.podstatus import now, ready_status
from finetune_local.resourcefit import parse_quantity
from finetune_local.restclient import ApiStatusError, RestClient, resource_path

logger = logging.getLogger(__name__)
LEASE_NAMESPACE = "kube-node-lease"
LEASE_API = "coordination.k8s.io/v1"
LEASE_DURATION_SECONDS = 40  # the kubelet's nodeLeaseDurationSeconds
# How often the local kubelet renews each lease: a real one every leaseDurationSeconds / 4.
DEFAULT_HEARTBEAT_SECONDS = 10.0

# A modest GPU-less cloud VM: room on each node for several of the operator's worker pods as
# it sends them to a real cluster (the data cache requests 32Gi of ephemeral-storage by
# default, `memory` what the job asks), so the shipped examples and the tests schedule.
DEFAULT_CAPACITY: dict[str, str] = {
    "cpu": "8",
    "memory": "32Gi",
    "ephemeral-storage": "200Gi",
    "pods": "110",
}
# The kubelet's default --eviction-hard thresholds, subtracted from capacity into allocatable.
EVICTION_HARD: dict[str, str] = {"memory": "100Mi", "ephemeral-storage": "10%"}


def check_node_resources(
    names: list[str], capacity: Mapping[str, str], per_node: Mapping[str, Mapping[str, str]]
) -> None:
    """Refuse a capacity that is no quantity, or a per-node one for a node that does not exist,
    naming which (ValueError)."""
    unknown = sorted(set(per_node) - set(names))
    if unknown:
        raise ValueError(f"node_resources names no such node: {unknown} (nodes are {names})")
    for where, values in [("node_capacity", capacity)] + [
        (f"node_resources[{n!r}]", v) for n, v in per_node.items()
    ]:
        for name, value in values.items():
            try:
                parse_quantity(value)
            except ValueError as err:
                raise ValueError(f"{where}[{name!r}]: {err}") from None


def node_allocatable(capacity: Mapping[str, str]) -> dict[str, str]:
    """Capacity less the kubelet's hard-eviction thresholds (a percentage is of capacity)."""
    allocatable = dict(capacity)
    for name, threshold in EVICTION_HARD.items():
        if name not in capacity:
            continue
        total = parse_quantity(capacity[name])
        if threshold.endswith("%"):
            reserved = total * parse_quantity(threshold[:-1]) / 100
        else:
            reserved = parse_quantity(threshold)
        allocatable[name] = str(max(math.floor(total - reserved), 0))
    return allocatable


def _node_id(name: str, kind: str) -> str:
    return uuid.uuid5(uuid.NAMESPACE_DNS, f"{kind}.{name}.local-cluster").hex


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
        "allocatable": node_allocatable(capacity),
        "addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": name},
        ],
        "conditions": [ready_condition()],
        # Every field a kubelet reports (the API's required ones: clients refuse a Node
        # without them); the ids are made up, stable per node name.
        "nodeInfo": {
            "machineID": _node_id(name, "machine"),
            "systemUUID": _node_id(name, "system"),
            "bootID": _node_id(name, "boot"),
            "kernelVersion": platform.release(),
            "osImage": "local processes",
            "containerRuntimeVersion": "local://process",
            "kubeletVersion": "v1.32.0-local",
            "kubeProxyVersion": "v1.32.0-local",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }
    await client.merge_patch(
        resource_path("v1", "nodes", name=name, subresource="status"), {"status": status}
    )
    await renew_lease(client, name)


def ready_condition() -> dict[str, Any]:
    stamp = now()
    return {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "message": "local kubelet is posting ready status",
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }


def micro_time() -> str:
    """A Lease's MicroTime (RFC 3339 with microseconds)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def renew_lease(client: RestClient, name: str) -> None:
    """Renew the node's Lease, creating it (owned by its Node, as a kubelet's) if absent."""
    path = resource_path(LEASE_API, "leases", LEASE_NAMESPACE, name)
    try:
        await client.merge_patch(path, {"spec": {"renewTime": micro_time()}})
        return
    except ApiStatusError as err:
        if err.status != 404:
            raise
    node = await client.get(resource_path("v1", "nodes", name=name))
    lease = {
        "metadata": {
            "name": name,
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"]["uid"]}
            ],
        },
        "spec": {
            "holderIdentity": name,
            "leaseDurationSeconds": LEASE_DURATION_SECONDS,
            "renewTime": micro_time(),
        },
    }
    with contextlib.suppress(ApiStatusError):  # created meanwhile: renewed next time
        await client.create(resource_path(LEASE_API, "leases", LEASE_NAMESPACE), lease)


async def heartbeat_forever(
    client: RestClient,
    names: Collection[str],
    nodes: Callable[[str], Mapping[str, Any] | None],
    lost: Collection[str],
    interval: float,
) -> None:
    """The kubelet's heartbeats, for each node not `lost`: its Lease renewed every `interval`,
    and its Ready condition posted again when the API holds another (a kubelet compares the
    status it computes with the Node's and patches what differs). `nodes`: the Node as the
    kubelet's cache has it."""
    while True:
        for name in names:
            if name in lost:
                continue
            try:
                await renew_lease(client, name)
                node = nodes(name)
                if node is not None and ready_status(node) != "True":
                    await client.merge_patch(
                        resource_path("v1", "nodes", name=name, subresource="status"),
                        {"status": {"conditions": [ready_condition()]}},
                    )
            except ApiStatusError as err:
                logger.debug("heartbeat of node %s: %s", name, err)
        await asyncio.sleep(interval)
