"""PodGC (kube-controller-manager's pod garbage collector), for pods no kubelet will finish.

Every ``period`` (20 s in Kubernetes, a constant there):
- **orphaned pods**: a pod bound to a node that no longer exists is force-deleted once the
  node has been absent for ``quarantine`` (40 s in Kubernetes: a node re-registering after a
  restart keeps its pods), after the node's absence is confirmed by a fresh read;
- **terminating pods on an out-of-service node**: a terminating pod on a node that is not
  Ready and carries the ``node.kubernetes.io/out-of-service`` taint (an admin's word that
  the node is dead and its workloads may move: non-graceful node shutdown) is force-deleted.

Each is first marked as Kubernetes marks it: phase Failed unless it already finished, and
for an orphan a ``DisruptionTarget`` condition (``DeletionByPodGC``, "PodGC: node no longer
exists"); then deleted with a grace period of 0. Not modelled: the collection of finished
pods over ``--terminated-pod-gc-threshold`` and of unscheduled terminating pods.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping
from typing import Any

from finetune_local.podstatus import ready_status, timestamp
from finetune_local.restclient import ApiStatusError, RestClient, resource_path
from finetune_local.tainteviction import disruption_conditions
from finetune_local.taints import TAINT_OUT_OF_SERVICE, node_taints

logger = logging.getLogger(__name__)
DEFAULT_PERIOD_SECONDS = 20.0
DEFAULT_QUARANTINE_SECONDS = 40.0
ORPHAN_REASON = "DeletionByPodGC"
ORPHAN_MESSAGE = "PodGC: node no longer exists"


def out_of_service(node: Mapping[str, Any]) -> bool:
    """Not Ready and tainted out-of-service: its terminating pods may be force-deleted."""
    return ready_status(node) != "True" and any(
        t.get("key") == TAINT_OUT_OF_SERVICE for t in node_taints(node)
    )


class PodGC:
    def __init__(self, client: RestClient, period: float, quarantine: float) -> None:
        self.client, self.period, self.quarantine = client, period, quarantine
        self._absent_since: dict[str, datetime.datetime] = {}

    async def run_forever(self) -> None:
        while True:
            try:
                await self.collect(datetime.datetime.now(datetime.UTC))
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("pod GC pass failed")
            await asyncio.sleep(self.period)

    async def collect(self, now: datetime.datetime) -> None:
        nodes = {
            n["metadata"]["name"]: n
            for n in (await self.client.get(resource_path("v1", "nodes")))["items"]
        }
        pods = (await self.client.get(resource_path("v1", "pods")))["items"]
        bound = {p["spec"]["nodeName"] for p in pods if p.get("spec", {}).get("nodeName")}
        absent = bound - set(nodes)
        self._absent_since = {n: self._absent_since.get(n, now) for n in absent}
        confirmed = set()
        for name in absent:
            waited = (now - self._absent_since[name]).total_seconds()
            if waited >= self.quarantine and await self._node_absent(name):
                confirmed.add(name)
        for pod in pods:
            node = pod.get("spec", {}).get("nodeName")
            if node in confirmed:
                await self._force_delete(pod, now, (ORPHAN_REASON, ORPHAN_MESSAGE))
            elif (
                node in nodes
                and pod["metadata"].get("deletionTimestamp")
                and out_of_service(nodes[node])
            ):
                await self._force_delete(pod, now, None)

    async def _node_absent(self, name: str) -> bool:
        try:
            await self.client.get(resource_path("v1", "nodes", name=name))
        except ApiStatusError as err:
            return err.status == 404
        return False

    async def _force_delete(
        self, pod: Mapping[str, Any], now: datetime.datetime, condition: tuple[str, str] | None
    ) -> None:
        meta = pod["metadata"]
        ns, name = meta["namespace"], meta["name"]
        status: dict[str, Any] = {}
        if pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
            status["phase"] = "Failed"
        if condition is not None:
            stamp = timestamp(now)
            status["conditions"] = disruption_conditions(pod, *condition, stamp)
        logger.info("pod GC: force-deleting pod %s/%s (node %s)", ns, name, pod["spec"]["nodeName"])
        try:
            if status:
                await self.client.merge_patch(
                    resource_path("v1", "pods", ns, name, "status"), {"status": status}
                )
            await self.client.delete(resource_path("v1", "pods", ns, name), grace_period_seconds=0)
        except ApiStatusError as err:
            logger.debug("pod GC of %s/%s: %s", ns, name, err)
