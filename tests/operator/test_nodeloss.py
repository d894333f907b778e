"""Pods lost with their node (reconcile/nodeloss.py): the pure decision, table-driven, and what
one reconcile pass does with it (force-delete, replace at once, count a preemption, say so)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest

from finetune_operator.api.constants import COND_SUCCEEDED, COND_WORKERS_READY
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import Outcome, PodView, observe_pod, reconcile_job
from finetune_operator.reconcile.conditions import find
from finetune_operator.reconcile.nodeloss import (
    NodeReading,
    NodeView,
    absent_node,
    lost_pods,
    suspect_nodes,
    view_node,
)
from tests.operator.factories import make_plan, quickstart_raw
from tests.operator.test_reconcile import JOB, T0, iso, running

NODE_LOST = 60  # faultTolerance.nodeLostSeconds
DOWN = T0  # when the node's Ready stopped being True
GRACE = 120  # the worker's terminationGracePeriodSeconds
EVICTED = T0 + timedelta(seconds=NODE_LOST)  # the taint eviction: nodeLostSeconds after down


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def terminating(
    name: str = "qs-worker-1",
    *,
    deleted: datetime | None = EVICTED,
    grace: int = GRACE,
    node: str = "node-b",
    uid: str | None = None,
) -> PodView:
    """A running pod deleted at `deleted` (None: not deleted) with `grace` seconds."""
    role = "rendezvous" if name.endswith("rdzv") else "worker"
    labels = {"finetune.dev/job": "qs", "finetune.dev/role": role}
    if role == "worker":
        labels["finetune.dev/worker-index"] = name.rsplit("-", 1)[1]
    meta: dict[str, Any] = {"name": name, "uid": uid or f"uid-{name}", "labels": labels}
    if deleted is not None:
        meta["deletionTimestamp"] = iso(deleted + timedelta(seconds=grace))
        meta["deletionGracePeriodSeconds"] = grace
    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]}
    return observe_pod({"metadata": meta, "spec": {"nodeName": node}, "status": status})


def node(ready: str = "Unknown", since: datetime | None = DOWN) -> NodeView:
    return NodeView("node-b", ready=ready, since=since, reason="NodeStatusUnknown")


@pytest.mark.parametrize(
    ("pod", "view", "now", "lost"),
    [
        # The taint eviction of a lost node: deleted nodeLostSeconds after it went down, so
        # no kubelet saw the deletion: lost at once, not only after the 120 s grace.
        (terminating(), node("Unknown"), at(NODE_LOST), True),
        # Ready False: the kubelet posts it, so it is alive and stops the pod gracefully: lost
        # only once that grace is over (a runtime that cannot kill it).
        (terminating(), node("False"), at(NODE_LOST), False),
        (terminating(), node("False"), at(NODE_LOST + GRACE - 1), False),
        (terminating(), node("False"), at(NODE_LOST + GRACE), True),
        (terminating(), node("Unknown"), at(NODE_LOST - 1), False),  # not down long enough
        (terminating(), node("True"), at(1000), False),  # back: its kubelet finishes it
        (terminating(), node("", since=None), at(1000), False),  # never posted: not judged
        (terminating(deleted=None), node("Unknown"), at(1000), False),  # not terminating
        # Deleted before the node went down: its kubelet may be stopping it gracefully: lost
        # only once the grace is over (deletionTimestamp passed).
        (terminating(deleted=at(-10)), node("Unknown"), at(NODE_LOST), False),
        (terminating(deleted=at(-10)), node("Unknown"), at(GRACE - 11), False),
        (terminating(deleted=at(-10)), node("Unknown"), at(GRACE - 10), True),
        # The Node deleted: lost once the grace is over (PodGC would take it 40 s later).
        (terminating(deleted=at(0)), absent_node("node-b"), at(GRACE - 1), False),
        (terminating(deleted=at(0)), absent_node("node-b"), at(GRACE), True),
        # The rendezvous pod, lost the same way (the workers cannot re-form without it).
        (terminating("qs-rdzv", grace=30), node("Unknown"), at(NODE_LOST), True),
    ],
    ids=[
        "evicted-unknown", "evicted-notready", "evicted-notready-within-grace",
        "evicted-notready-grace-over", "down-too-short", "node-ready-again",
        "no-ready-condition", "not-terminating", "deleted-before-down-within-grace",
        "deleted-before-down-grace-bound", "deleted-before-down-grace-over",
        "node-absent-within-grace", "node-absent-grace-over", "rendezvous",
    ],
)  # fmt: skip
def test_lost_pods(pod: PodView, view: NodeView, now: datetime, lost: bool) -> None:
    reading = NodeReading({view.name: view})
    found = lost_pods([pod], reading, now, NODE_LOST)
    assert [x.pod.name for x in found] == ([pod.name] if lost else [])


def test_unread_node_and_already_force_deleted_pods_are_not_judged() -> None:
    pod = terminating()
    assert lost_pods([pod], NodeReading({}), at(1000), NODE_LOST) == ()
    done = NodeReading({"node-b": node()}, force_deleted=frozenset({pod.uid}))
    assert lost_pods([pod], done, at(1000), NODE_LOST) == ()


def test_suspects_are_the_nodes_of_terminating_pods_and_of_not_ready_running_workers() -> None:
    healthy = replace(terminating("qs-worker-0", deleted=None, node="node-a"), ready=True)
    assert suspect_nodes([terminating(), healthy]) == {"node-b"}
    # Marked not Ready by the node lifecycle controller (its node stopped answering).
    unready = terminating("qs-worker-0", deleted=None, node="node-c")
    assert suspect_nodes([terminating(), healthy, unready]) == {"node-b", "node-c"}


def test_view_of_a_node_object() -> None:
    ready = {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
             "lastTransitionTime": iso(DOWN)}  # fmt: skip
    view = view_node({"metadata": {"name": "node-b"}, "status": {"conditions": [ready]}})
    assert view == NodeView("node-b", True, "Unknown", DOWN, "NodeStatusUnknown")
    assert view_node({"metadata": {"name": "n"}}) == NodeView("n")


def test_the_event_names_pod_node_and_how_long() -> None:
    (found,) = lost_pods([terminating()], NodeReading({"node-b": node()}), at(75), NODE_LOST)
    text = found.describe()
    assert "qs-worker-1" in text and "node-b" in text and "75 s" in text
    assert "NodeStatusUnknown" in text and "not counted against maxRestarts" in text


def step(pods: list[PodView], reading: NodeReading | None, now: datetime, **status: Any) -> Outcome:
    raw = quickstart_raw()
    raw["faultTolerance"]["nodeLostSeconds"] = NODE_LOST
    return reconcile_job(
        JOB, raw, FineTuneJobStatus(**status), pods, now,
        planner=lambda _: make_plan(2), ensured_generation=1, nodes=reading,
    )  # fmt: skip


def test_a_pass_force_deletes_the_lost_pod_replaces_it_and_counts_a_preemption() -> None:
    pods = [*running("qs-rdzv", "qs-worker-0"), terminating()]
    out = step(pods, NodeReading({"node-b": node()}), at(NODE_LOST + 2), preemptions=1)
    (deletion,) = out.actions.delete
    assert (deletion.name, deletion.uid, deletion.grace_seconds) == ("qs-worker-1", "uid-qs-worker-1", 0)  # fmt: skip
    assert deletion.reason == "NodeLost"
    # The slot is filled in this same pass: the force delete comes first in the apply.
    assert [p["metadata"]["name"] for p in out.actions.create] == ["qs-worker-1"]
    assert out.status.preemptions == 2 and out.status.restarts == 0
    (event,) = [e for e in out.events if e.reason == "NodeLost"]
    assert event.type == "Warning" and "node-b" in event.message
    succeeded = find(out.status.conditions, COND_SUCCEEDED)
    assert succeeded is not None and "lost with node node-b" in succeeded.message


@pytest.mark.parametrize(
    "reading",
    [
        None,
        NodeReading({"node-b": node("True")}),
    ],
    ids=["not-read", "node-ready"],
)
def test_a_pass_waits_for_a_terminating_pod_that_is_not_lost(reading: NodeReading | None) -> None:
    pods = [*running("qs-rdzv", "qs-worker-0"), terminating()]
    out = step(pods, reading, at(NODE_LOST + 2))
    assert out.actions.delete == () and out.actions.create == ()
    assert out.status.preemptions == 0


def test_a_lost_pod_still_listed_is_force_deleted_again_never_counted_again() -> None:
    """The first pass's force delete refused (a 5xx, a timeout) or not yet seen by the watch:
    the next pass sends it again, with no second preemption, Event or status.nodeLosses entry."""
    pods = [*running("qs-rdzv", "qs-worker-0"), terminating()]
    first = step(pods, NodeReading({"node-b": node()}), at(NODE_LOST + 2))
    counted = frozenset(d.uid for d in first.actions.delete if d.reason == "NodeLost")
    assert counted == {"uid-qs-worker-1"} and first.status.preemptions == 1
    reading = NodeReading({"node-b": node()}, force_deleted=counted)
    status = first.status.model_dump()
    again = step(pods, reading, at(NODE_LOST + 7), **status)
    assert [(d.name, d.uid, d.grace_seconds, d.reason) for d in again.actions.delete] == [
        ("qs-worker-1", "uid-qs-worker-1", 0, "NodeLost")
    ]
    assert [p["metadata"]["name"] for p in again.actions.create] == ["qs-worker-1"]
    assert again.status.preemptions == 1
    assert len(again.status.node_losses) == 1
    assert not [e for e in again.events if e.reason == "NodeLost"]


def test_a_lost_pod_of_a_suspended_job_goes_too() -> None:
    raw = quickstart_raw()
    raw["suspend"] = True
    out = reconcile_job(
        JOB, raw, FineTuneJobStatus(), [terminating()], at(NODE_LOST),
        planner=lambda _: make_plan(2), ensured_generation=1,
        nodes=NodeReading({"node-b": node()}),
    )  # fmt: skip
    assert [(d.name, d.grace_seconds) for d in out.actions.delete] == [("qs-worker-1", 0)]
    assert out.actions.create == () and out.status.preemptions == 0


def test_unreadable_nodes_are_said_in_the_workers_ready_condition() -> None:
    why = "the operator may not read node node-b (HTTP 403 Forbidden): grant it get on nodes"
    pods = [*running("qs-rdzv", "qs-worker-0"), terminating()]
    out = step(pods, NodeReading(unreadable={"node-b": why}), at(1000))
    ready = find(out.status.conditions, COND_WORKERS_READY)
    assert ready is not None and why in ready.message and "qs-worker-1" in ready.message
    assert out.actions.delete == ()
