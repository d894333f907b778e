"""The taints Kubernetes itself puts on nodes, and the tolerance rules the controllers share.

The node lifecycle controller taints a node whose Ready condition is not True (`not-ready`:
Ready False; `unreachable`: Ready Unknown, the kubelet stopped posting), NoSchedule and
NoExecute; an admin marks a dead node `out-of-service` so that PodGC force-deletes its
terminating pods. Only NoExecute taints carry `timeAdded`.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from finetune_local.scheduler import tolerates

TAINT_NOT_READY = "node.kubernetes.io/not-ready"
TAINT_UNREACHABLE = "node.kubernetes.io/unreachable"
TAINT_OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
NO_EXECUTE, NO_SCHEDULE = "NoExecute", "NoSchedule"
# The taint key the node lifecycle controller keeps for each status of the Ready condition.
READY_TAINT = {"False": TAINT_NOT_READY, "Unknown": TAINT_UNREACHABLE}


def parse_time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)


def node_taints(node: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [dict(t) for t in node.get("spec", {}).get("taints") or []]


def matching_tolerations(
    taints: Iterable[Mapping[str, Any]], tolerations: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]] | None:
    """Every toleration that tolerates one of `taints` (v1helper.GetMatchingTolerations), or
    None when one taint is tolerated by none."""
    used: list[Mapping[str, Any]] = []
    for taint in taints:
        found = [t for t in tolerations if tolerates(t, taint)]
        if not found:
            return None
        used.extend(found)
    return used


def min_toleration_seconds(tolerations: Sequence[Mapping[str, Any]]) -> float | None:
    """How long the pod may stay: the least `tolerationSeconds` among those that set one (0
    or less: not at all); None when none does (it may stay for ever)."""
    seconds = [
        float(t["tolerationSeconds"])
        for t in tolerations
        if isinstance(t.get("tolerationSeconds"), int | float)
    ]
    if not seconds:
        return None
    return max(0.0, min(seconds))
