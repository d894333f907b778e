"""The taint eviction controller (kube-controller-manager's TaintEvictionController, the
"taint manager"): pods bound to a node with NoExecute taints they do not tolerate are deleted.

For each pod on a node with NoExecute taints (`eviction_due`, pure):
- a taint no toleration of the pod tolerates: deleted at once;
- else the least ``tolerationSeconds`` among the tolerations that match the taints: deleted
  that long after the taint appeared; none of them sets seconds: never (it tolerates the
  taint for ever). Kubernetes times it from when the controller saw the taint, which is the
  taint's ``timeAdded`` here (this controller never restarts); a NoExecute taint without
  ``timeAdded`` (put there by hand) counts from when this controller first saw it.

Deleting a pod is what Kubernetes does: first a ``DisruptionTarget`` condition
(``DeletionByTaintManager``), then an ordinary (graceful) delete: ``deletionTimestamp`` set
to now plus the pod's grace period, and it is then up to the node's kubelet to finish it. A
kubelet that never answers (its node is lost) leaves the pod Terminating until someone
force-deletes it (or PodGC does, once the Node object is deleted or the node is marked
``out-of-service``: :mod:`.podgc`). Pods already terminating are left as they are.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from finetune_local.podstatus import timestamp
from finetune_local.restclient import ApiStatusError, RestClient, resource_path
from finetune_local.taints import (
    NO_EXECUTE,
    matching_tolerations,
    min_toleration_seconds,
    node_taints,
    parse_time,
)

logger = logging.getLogger(__name__)
DEFAULT_PERIOD_SECONDS = 1.0
REASON = "DeletionByTaintManager"
MESSAGE = "Taint manager: deleting due to NoExecute taint"
TaintKey = tuple[str, str, str]  # node, key, value


def eviction_due(
    pod: Mapping[str, Any], taints: Sequence[Mapping[str, Any]], added: Sequence[datetime.datetime]
) -> datetime.datetime | None:
    """When `pod` must go from a node with these NoExecute `taints` (`added`: when each
    appeared): the earliest taint's time when one is not tolerated (at once), that plus the
    least tolerationSeconds of the tolerations used, or None (never)."""
    if not taints:
        return None
    start = min(added)
    used = matching_tolerations(taints, pod.get("spec", {}).get("tolerations") or [])
    if used is None:
        return start
    seconds = min_toleration_seconds(used)
    return None if seconds is None else start + datetime.timedelta(seconds=seconds)


def disruption_conditions(pod: Mapping[str, Any], reason: str, message: str, stamp: str) -> list[dict[str, Any]]:  # fmt: skip
    """The pod's conditions with DisruptionTarget True added (or set) for `reason`."""
    out = [dict(c) for c in pod.get("status", {}).get("conditions") or [] if c.get("type") != "DisruptionTarget"]  # fmt: skip
    out.append(
        {"type": "DisruptionTarget", "status": "True", "reason": reason, "message": message,
         "lastTransitionTime": stamp}
    )  # fmt: skip
    return out


class TaintEvictionController:
    def __init__(self, client: RestClient, period: float) -> None:
        self.client, self.period = client, period
        self._first_seen: dict[TaintKey, datetime.datetime] = {}  # taints without timeAdded

    async def run_forever(self) -> None:
        while True:
            try:
                await self.evict(datetime.datetime.now(datetime.UTC))
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("taint eviction controller pass failed")
            await asyncio.sleep(self.period)

    def _added(self, node: str, taint: Mapping[str, Any], now: datetime.datetime) -> datetime.datetime:  # fmt: skip
        stated = parse_time(taint.get("timeAdded"))
        if stated is not None:
            return stated
        key = (node, str(taint.get("key") or ""), str(taint.get("value") or ""))
        return self._first_seen.setdefault(key, now)

    async def evict(self, now: datetime.datetime) -> None:
        """One pass: delete every pod whose time on its tainted node is up."""
        tainted: dict[str, tuple[list[dict[str, Any]], list[datetime.datetime]]] = {}
        for node in (await self.client.get(resource_path("v1", "nodes")))["items"]:
            name = node["metadata"]["name"]
            taints = [t for t in node_taints(node) if t.get("effect") == NO_EXECUTE]
            if taints:
                tainted[name] = (taints, [self._added(name, t, now) for t in taints])
        self._first_seen = {k: v for k, v in self._first_seen.items() if k[0] in tainted}
        if not tainted:
            return
        for pod in (await self.client.get(resource_path("v1", "pods")))["items"]:
            node = pod.get("spec", {}).get("nodeName")
            if node not in tainted or pod["metadata"].get("deletionTimestamp"):
                continue
            due = eviction_due(pod, *tainted[node])
            if due is not None and due <= now:
                await self._delete(pod, now)

    async def _delete(self, pod: Mapping[str, Any], now: datetime.datetime) -> None:
        meta = pod["metadata"]
        ns, name = meta["namespace"], meta["name"]
        stamp = timestamp(now)
        logger.info(
            "taint eviction: deleting pod %s/%s from node %s", ns, name, pod["spec"]["nodeName"]
        )
        try:
            await self.client.merge_patch(
                resource_path("v1", "pods", ns, name, "status"),
                {"status": {"conditions": disruption_conditions(pod, REASON, MESSAGE, stamp)}},
            )
            await self.client.delete(resource_path("v1", "pods", ns, name))
        except ApiStatusError as err:  # gone meanwhile
            logger.debug("taint eviction of %s/%s: %s", ns, name, err)
