"""The scheduler's side of the local kubelet: binds pending pods to nodes, one by one or, for
a gang scheduler installed here (:mod:`.podgroups`), a pod group all at once.

Which scheduler places a pod is its ``spec.schedulerName``: ``default-scheduler`` always runs;
a gang scheduler only when the session installed it. A pod that names a scheduler that is not
running stays Pending with no condition at all, as on a cluster without that scheduler. A
gang pod whose PodGroup does not exist is not placed either (both schedulers wait for it).

A pod that fits no node stays Pending with ``PodScheduled=False`` (reason ``Unschedulable``)
and a Warning event ``FailedScheduling`` from its scheduler, both with the scheduler's message
(``0/3 nodes are available: 3 Insufficient memory.``). The event is recorded on each failed
attempt (each kubelet pass, at least once a second, where kube-scheduler retries after a 1 to
10 s backoff or on a cluster change) through :class:`.events.EventRecorder`, which aggregates
the repeats into one Event with a ``series`` as the real scheduler's recorder does.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from finetune_local.events import EventRecorder
from finetune_local.informer import Cache, key_of, remember
from finetune_local.podgroups import GangScheduler, scheduler_for
from finetune_local.podstatus import now
from finetune_local.restclient import ApiStatusError, RestClient, resource_path
from finetune_local.scheduler import pick_node, place_gang, pods_by_node

DEFAULT_SCHEDULER = "default-scheduler"


async def _patch_status(
    client: RestClient, pods: Cache, pod: Mapping[str, Any], status: dict[str, Any]
) -> None:
    ns, name = key_of(pod)
    with contextlib.suppress(ApiStatusError):
        remember(
            pods,
            await client.merge_patch(
                resource_path("v1", "pods", ns, name, "status"), {"status": status}
            ),
        )


async def _failed_scheduling_event(
    events: EventRecorder, pod: Mapping[str, Any], message: str
) -> None:
    """The scheduler's event, as ``kubectl describe pod`` and ``kubectl get events`` show it."""
    ns, name = key_of(pod)
    scheduler = pod.get("spec", {}).get("schedulerName") or DEFAULT_SCHEDULER
    stamp = now()
    event = {
        "metadata": {"name": f"{name}.{uuid.uuid4().hex[:16]}", "namespace": ns},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": ns,
            "name": name,
            "uid": pod["metadata"].get("uid", ""),
        },
        "reason": "FailedScheduling",
        "message": message,
        "type": "Warning",
        "source": {"component": scheduler},
        "reportingComponent": scheduler,
        "action": "Scheduling",
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
    await events.record(event)


async def _unschedulable(
    client: RestClient, events: EventRecorder, pods: Cache, pod: Mapping[str, Any], message: str
) -> None:
    # Each failed attempt is an event, as kube-scheduler's; its recorder makes the repeats one
    # series. The condition is written when its message changes (the same one is a no-op).
    await _failed_scheduling_event(events, pod, message)
    current: Mapping[str, Any] = next(
        (c for c in pod.get("status", {}).get("conditions", []) if c["type"] == "PodScheduled"), {}
    )
    if current.get("message") != message:
        await _patch_status(
            client,
            pods,
            pod,
            {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": message,
                        "lastTransitionTime": now(),
                    }
                ]
            },
        )


async def _bind(client: RestClient, pods: Cache, pod: Mapping[str, Any], node: str) -> None:
    ns, name = key_of(pod)
    # A real scheduler POSTs a Binding; setting spec.nodeName has the same effect here.
    remember(
        pods,
        await client.merge_patch(
            resource_path("v1", "pods", ns, name), {"spec": {"nodeName": node}}
        ),
    )
    await _patch_status(
        client,
        pods,
        pod,
        {"conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now()}]},
    )


def _active(pod: Mapping[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and pod.get("status", {}).get(
        "phase"
    ) not in ("Succeeded", "Failed")


async def _schedule_group(
    client: RestClient,
    events: EventRecorder,
    pods: Cache,
    nodes: list[Mapping[str, Any]],
    gang: GangScheduler,
    namespace: str,
    group: str,
) -> None:
    try:
        pod_group = await client.get(
            resource_path(f"{gang.group}/{gang.version}", "podgroups", namespace, group)
        )
    except ApiStatusError as err:
        if err.status != 404:
            raise
        return  # no group yet: its pods wait for it
    members = [
        p
        for p in pods.values()
        if p["metadata"].get("namespace") == namespace
        and gang.group_of(dict(p)) == group
        and scheduler_for(dict(p), [gang])
        and _active(p)
    ]
    pending = [p for p in members if not p.get("spec", {}).get("nodeName")]
    # Coscheduling counts the members its snapshot has on a node: one bound to a node that is
    # gone (deleted, its pods not yet collected) runs nowhere and holds no place in the gang.
    names = {n["metadata"]["name"] for n in nodes}
    bound = sum(1 for p in members if p.get("spec", {}).get("nodeName") in names)
    min_member = int(pod_group.get("spec", {}).get("minMember") or 1)
    chosen, why = place_gang(pending, bound, min_member, nodes, pods_by_node(pods.values()))
    for pod in pending:
        if pod["metadata"]["name"] in chosen:
            await _bind(client, pods, pod, chosen[pod["metadata"]["name"]])
        else:
            await _unschedulable(client, events, pods, pod, why or "0 nodes fit the pod")


async def schedule_pod(
    client: RestClient,
    events: EventRecorder,
    pods: Cache,
    nodes: list[Mapping[str, Any]],
    pod: Mapping[str, Any],
    gangs: Sequence[GangScheduler],
) -> None:
    """Place ``pod`` (unbound), or its whole group; or say why not in its PodScheduled condition."""
    current = pods.get(key_of(pod), pod)
    if current.get("spec", {}).get("nodeName"):
        return  # bound with its group earlier in this pass
    gang = scheduler_for(dict(current), list(gangs))
    if gang is not None:
        group = gang.group_of(dict(current))
        if group:
            await _schedule_group(client, events, pods, nodes, gang, key_of(current)[0], group)
            return
    elif (current.get("spec", {}).get("schedulerName") or DEFAULT_SCHEDULER) != DEFAULT_SCHEDULER:
        return  # no such scheduler runs here
    node, message = pick_node(current, nodes, pods_by_node(pods.values()))
    if node is None:
        await _unschedulable(client, events, pods, current, message)
    else:
        await _bind(client, pods, current, node)
