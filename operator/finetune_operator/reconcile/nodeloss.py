"""Which of a job's pods are lost with their node (pure, `now` passed in).

On a real cluster a node that stops answering (power loss, a network partition, a dead
kubelet) is marked Ready Unknown by the node lifecycle controller after its monitor grace
period (40-50 s) and tainted `node.kubernetes.io/unreachable:NoExecute`; the taint eviction
controller deletes its pods once their toleration runs out (`faultTolerance.nodeLostSeconds`:
resources/common.pod_tolerations). That delete is graceful: the pod gets a
`deletionTimestamp` and stays Terminating until its kubelet confirms it, which a lost node's
never does. Worker pods have fixed names (`<job>-worker-<i>`), and a slot's replacement is
created only once the old pod object is gone (actions.py): the job would wait for ever.

A terminating pod is **lost** when its node:
- is absent (the Node object deleted) and the pod's grace period has run out
  (`deletionTimestamp` passed: a live kubelet would have stopped it by then); or
- has a Ready condition that has not been True for at least `node_lost_seconds`, and either
  it is Unknown (the kubelet stopped posting) and the pod was deleted after that (no kubelet
  ever saw the deletion, so no graceful stop is under way that waiting would protect: a lost
  pod's peers have moved on, and its final save, a collective, cannot happen), or the pod's
  grace period has run out. Ready False is the kubelet's own post (the node lifecycle
  controller only ever writes Unknown): that kubelet is alive, sees the deletion and stops
  the pod gracefully, so only a pod past its grace (a runtime that cannot kill it) is lost.
  Its `lastTransitionTime` is also the node's clock, not the control plane's.

Lost pods are force-deleted (grace 0, uid precondition) so that their replacements can be
created, and counted as preemptions. The processes of a pod on a partitioned node may still
run until the partition heals (then its kubelet kills them, the object being gone): two
incarnations of a slot may run for that while; the trainer's checkpoint fencing keeps the
stale one from writing over the new one's checkpoints (docs/checkpoints.md).

A pod that is *not* terminating on such a node (its toleration has no `tolerationSeconds`,
the user's choice: "wait for this node") is left alone: deleting it would override that
choice, and Kubernetes' own eviction takes care of every pod that tolerates the node for a
bounded time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from finetune_operator.reconcile.observed import RUNNING, PodView, parse_time


@dataclass(frozen=True)
class NodeView:
    """What the decision needs of a Node: whether it exists, and its Ready condition."""

    name: str
    exists: bool = True
    ready: str = ""  # the Ready condition's status: "True", "False", "Unknown"; "" without one
    since: datetime | None = None  # its lastTransitionTime
    reason: str = ""  # its reason (NodeStatusUnknown: the kubelet stopped posting)


def view_node(node: Mapping[str, Any]) -> NodeView:
    """A Node object (a dict as the API serves it) as the decision sees it."""
    name = str((node.get("metadata") or {}).get("name") or "")
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return NodeView(
                name,
                ready=str(cond.get("status") or ""),
                since=parse_time(cond.get("lastTransitionTime")),
                reason=str(cond.get("reason") or ""),
            )
    return NodeView(name)


def absent_node(name: str) -> NodeView:
    return NodeView(name, exists=False)


@dataclass(frozen=True)
class NodeReading:
    """What a pass read of the Nodes of its suspect pods (`suspect_nodes`).

    `views`: by node name (a node not there was not read: nothing is decided for its pods);
    `unreadable`: node name -> why it could not be read (RBAC: the chart's ClusterRole);
    `force_deleted`: uids of pods this operator already judged lost and counted, whether its
    force delete went through (the pods index may not show the removal yet) or was refused
    (a 5xx, a timeout, a 429: it is sent again, `lost_again`), so never counted twice;
    `rounds`: by pod uid, the rendezvous round its trainers were last seen training in
    (their metrics), and `seen_at` when; `counted_at`: by round id, the pass that first
    counted it in status.restartLedger (forgiveness.py: which counted round a lost pod
    accounts for). The last three are the operator's memory: empty after its restart."""

    views: Mapping[str, NodeView] = field(default_factory=dict)
    unreadable: Mapping[str, str] = field(default_factory=dict)
    force_deleted: frozenset[str] = frozenset()
    rounds: Mapping[str, str] = field(default_factory=dict)
    seen_at: Mapping[str, datetime] = field(default_factory=dict)
    counted_at: Mapping[str, datetime] = field(default_factory=dict)


@dataclass(frozen=True)
class LostPod:
    pod: PodView
    node: NodeView
    down_seconds: float | None  # how long its Ready has not been True; None: node absent
    # The round it was last seen training in: its peers' collectives time out in that round
    # (a silent loss), which is the node's doing, not a failure to count (budget.py).
    round: str | None = None
    seen_at: datetime | None = None  # when its trainers last said `round`

    def describe(self) -> str:
        """The NodeLost Event's message: the pod, the node and how long it has been away."""
        if self.down_seconds is None:
            how = f"node {self.node.name} no longer exists"
        else:
            cause = f", {self.node.reason}" if self.node.reason else ""
            how = (
                f"node {self.node.name} has not been Ready for {self.down_seconds:.0f} s "
                f"(Ready {self.node.ready or 'missing'}{cause})"
            )
        return (
            f"pod {self.pod.name} is lost with its node: {how}, and no kubelet confirms its "
            "deletion; force-deleting it so that its replacement can start "
            "(a preemption: not counted against maxRestarts)"
        )


def suspect_nodes(pods: Iterable[PodView]) -> frozenset[str]:
    """The nodes to read: those of the job's terminating pods, and of its running workers
    that are not Ready (the node lifecycle controller marks the pods of a node that stopped
    answering so: forgiveness.budget_hold). Both transient on a healthy cluster (a pod being
    deleted is gone within its grace period; workers have no readiness probe), so rarely any."""
    return frozenset(
        p.node
        for p in pods
        if p.node and (p.terminating or (p.is_worker and p.phase == RUNNING and not p.ready))
    )


def _lost(pod: PodView, node: NodeView, now: datetime, node_lost_seconds: int) -> LostPod | None:  # fmt: skip
    deadline = pod.deletion_deadline
    if deadline is None:
        return None  # deleted by us this pass, not yet seen deleted: nothing known
    grace_over = now >= deadline
    if not node.exists:
        return LostPod(pod, node, None) if grace_over else None
    if node.ready == "True" or node.since is None:
        return None  # a kubelet that answers finishes it; one that never posted is not judged
    down = (now - node.since).total_seconds()
    if down < node_lost_seconds:
        return None
    deleted_at = deadline - timedelta(seconds=pod.deletion_grace or 0)
    # Only a silent kubelet (Unknown) never saw the deletion; one posting False did.
    deleted_while_down = (
        node.ready == "Unknown" and pod.deletion_grace is not None and deleted_at >= node.since
    )
    return LostPod(pod, node, down) if deleted_while_down or grace_over else None


def lost_pods(
    pods: Sequence[PodView], reading: NodeReading, now: datetime, node_lost_seconds: int
) -> tuple[LostPod, ...]:
    """The job's terminating pods that are lost with their node (the module docstring)."""
    out = []
    for pod in pods:
        if not pod.terminating or not pod.node or pod.uid in reading.force_deleted:
            continue
        node = reading.views.get(pod.node)
        lost = _lost(pod, node, now, node_lost_seconds) if node is not None else None
        if lost is not None:
            uid = pod.uid
            out.append(
                replace(lost, round=reading.rounds.get(uid), seen_at=reading.seen_at.get(uid))
            )
    return tuple(out)


def lost_again(pods: Sequence[PodView], reading: NodeReading) -> tuple[PodView, ...]:
    """Pods judged lost and counted on an earlier pass that are still listed: their force
    delete failed, or the watch has not shown it yet. It is sent again (a 404 or a 409 then
    only says it is done), never counted again."""
    return tuple(p for p in pods if p.terminating and p.uid in reading.force_deleted)


def unreadable_detail(pods: Sequence[PodView], reading: NodeReading) -> str:
    """For the WorkersReady condition: which terminating pods cannot be judged, and why."""
    stuck = [p for p in pods if p.terminating and p.node in reading.unreadable]
    if not stuck:
        return ""
    first = stuck[0]
    names = ", ".join(p.name for p in stuck[:3])
    return (
        f"cannot tell whether terminating pods ({names}) are lost with their node: "
        f"{reading.unreadable[first.node or '']}"
    )
