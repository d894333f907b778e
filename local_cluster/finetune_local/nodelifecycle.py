"""The node lifecycle controller (kube-controller-manager's): a node that stops heartbeating
is marked Unknown, tainted and its pods marked not Ready; one that heartbeats again is Ready
and untainted (by the kubelet's own post and this controller's next pass).

Every ``period`` (``--node-monitor-period``, 5 s) it compares each node's heartbeat, its
Lease's ``renewTime`` and its Ready condition's ``lastHeartbeatTime``, with what it saw
before, and notes *its own* time of the last change (never the timestamps themselves: the
node's clock is not the controller's). A node whose heartbeat has not changed for ``grace``
(``--node-monitor-grace-period``: 50 s since Kubernetes 1.32, 40 s before, which this
emulator's v1.32 follows) gets its Ready condition set Unknown (``NodeStatusUnknown``,
"Kubelet stopped posting node status."). Then, from the Ready condition:

- taints (``doNoScheduleTaintingPass``, ``doNoExecuteTaintingPass``): Ready False is
  ``node.kubernetes.io/not-ready``, Unknown ``node.kubernetes.io/unreachable``, each with
  effect NoSchedule and NoExecute (only the NoExecute one has ``timeAdded``); Ready True has
  neither;
- the pods bound to a node that is not Ready get their Ready condition False
  (``MarkPodsNotReady``).

Not modelled: the other node conditions (MemoryPressure, DiskPressure, PIDPressure), the
startup grace of a node that never posted, and the per-zone eviction rate limits (tainting
is at once for every node).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from finetune_local.podstatus import ready_status, timestamp
from finetune_local.restclient import ApiStatusError, RestClient, resource_path
from finetune_local.taints import (
    NO_EXECUTE,
    NO_SCHEDULE,
    READY_TAINT,
    node_taints,
)

logger = logging.getLogger(__name__)
DEFAULT_GRACE_SECONDS = 50.0
DEFAULT_PERIOD_SECONDS = 5.0
UNKNOWN_REASON = "NodeStatusUnknown"
UNKNOWN_MESSAGE = "Kubelet stopped posting node status."


def heartbeat_of(node: Mapping[str, Any], lease: Mapping[str, Any] | None) -> tuple[str, str]:
    """What changes when the kubelet heartbeats: its Lease's renewTime, its Ready condition's
    lastHeartbeatTime."""
    renew = str((lease or {}).get("spec", {}).get("renewTime") or "")
    beat = ""
    for cond in node.get("status", {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            beat = str(cond.get("lastHeartbeatTime") or "")
    return renew, beat


def unknown_conditions(
    conditions: Sequence[Mapping[str, Any]], stamp: str
) -> list[dict[str, Any]] | None:
    """The node's conditions with Ready set Unknown, as the controller writes them (its last
    heartbeat kept, the transition now); None when Ready is Unknown already."""
    out = [dict(c) for c in conditions]
    ready = next((c for c in out if c.get("type") == "Ready"), None)
    if ready is None:
        ready = {"type": "Ready", "lastHeartbeatTime": None}
        out.append(ready)
    elif ready.get("status") == "Unknown":
        return None
    ready.update(
        status="Unknown", reason=UNKNOWN_REASON, message=UNKNOWN_MESSAGE, lastTransitionTime=stamp
    )
    return out


def wanted_taints(
    taints: Sequence[Mapping[str, Any]], ready: str, stamp: str
) -> list[dict[str, Any]]:
    """The node's taints with the not-ready/unreachable ones matching its Ready condition: the
    one it should have kept as it is (its timeAdded too), the other removed."""
    keep_key = READY_TAINT.get(ready)
    ours = set(READY_TAINT.values())
    out = [dict(t) for t in taints if t.get("key") not in ours or t.get("key") == keep_key]
    if keep_key is None:
        return out
    for effect in (NO_SCHEDULE, NO_EXECUTE):
        if not any(t.get("key") == keep_key and t.get("effect") == effect for t in out):
            taint: dict[str, Any] = {"key": keep_key, "effect": effect}
            if effect == NO_EXECUTE:
                taint["timeAdded"] = stamp
            out.append(taint)
    return out


def pods_to_mark_not_ready(
    pods: Sequence[Mapping[str, Any]], unready_nodes: set[str]
) -> list[Mapping[str, Any]]:
    """Pods bound to a node that is not Ready whose own Ready condition is still True."""
    return [
        p
        for p in pods
        if p.get("spec", {}).get("nodeName") in unready_nodes and ready_status(p) == "True"
    ]


def not_ready_conditions(pod: Mapping[str, Any], stamp: str) -> list[dict[str, Any]]:
    out = [dict(c) for c in pod.get("status", {}).get("conditions") or []]
    for cond in out:
        if cond.get("type") == "Ready":
            cond.update(status="False", lastTransitionTime=stamp)
    return out


@dataclass
class _Seen:
    heartbeat: tuple[str, str]
    at: datetime.datetime  # the controller's time of the last change it saw


class NodeLifecycleController:
    def __init__(self, client: RestClient, grace: float, period: float) -> None:
        self.client, self.grace, self.period = client, grace, period
        self._seen: dict[str, _Seen] = {}

    async def run_forever(self) -> None:
        while True:
            try:
                await self.monitor(datetime.datetime.now(datetime.UTC))
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("node lifecycle controller pass failed")
            await asyncio.sleep(self.period)

    async def monitor(self, now: datetime.datetime) -> None:
        """One pass over every node (`now`: the controller's clock)."""
        nodes = (await self.client.get(resource_path("v1", "nodes")))["items"]
        leases = await self.client.get(
            resource_path("coordination.k8s.io/v1", "leases", "kube-node-lease")
        )
        by_name = {lease["metadata"]["name"]: lease for lease in leases["items"]}
        self._seen = {
            k: v for k, v in self._seen.items() if k in {n["metadata"]["name"] for n in nodes}
        }
        unready: set[str] = set()
        for node in nodes:
            name = node["metadata"]["name"]
            beat = heartbeat_of(node, by_name.get(name))
            seen = self._seen.get(name)
            if seen is None or seen.heartbeat != beat:
                self._seen[name] = seen = _Seen(beat, now)
            stamp = timestamp(now)
            if (now - seen.at).total_seconds() > self.grace:
                conditions = unknown_conditions(
                    node.get("status", {}).get("conditions") or [], stamp
                )
                if conditions is not None:
                    logger.info("node %s: %s", name, UNKNOWN_MESSAGE)
                    node = await self._patch(name, {"status": {"conditions": conditions}}, "status")
            ready = ready_status(node)
            if ready != "True":
                unready.add(name)
            taints = wanted_taints(node_taints(node), ready, stamp)
            if taints != node_taints(node):
                # On the version read: a taint an admin adds meanwhile is not lost (409: the
                # next pass tries again).
                version = node["metadata"]["resourceVersion"]
                body = {
                    "metadata": {"resourceVersion": version},
                    "spec": {"taints": taints or None},
                }
                try:
                    await self._patch(name, body)
                except ApiStatusError as err:
                    logger.debug("tainting node %s: %s", name, err)
        if unready:
            await self._mark_pods_not_ready(unready, timestamp(now))

    async def _patch(self, name: str, body: dict[str, Any], sub: str | None = None) -> Any:
        path = resource_path("v1", "nodes", name=name, subresource=sub)
        return await self.client.merge_patch(path, body)

    async def _mark_pods_not_ready(self, nodes: set[str], stamp: str) -> None:
        pods = (await self.client.get(resource_path("v1", "pods")))["items"]
        for pod in pods_to_mark_not_ready(pods, nodes):
            meta = pod["metadata"]
            path = resource_path("v1", "pods", meta["namespace"], meta["name"], "status")
            body = {"status": {"conditions": not_ready_conditions(pod, stamp)}}
            try:
                await self.client.merge_patch(path, body)
            except ApiStatusError as err:  # deleted meanwhile
                logger.debug("marking pod %s not ready: %s", meta["name"], err)
