"""The Kueue side of decide_actions (pure): the job's Workload to write, its status patches
(PodsReady, the quota given back, Finished), its resource-in-use finalizer, and when it is
deleted. actions.py puts them into the pass's Actions."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from finetune_operator.reconcile.action_types import ObjectRef
from finetune_operator.reconcile.admission import FAILED_TO_START
from finetune_operator.reconcile.assess import Assessment, Mode
from finetune_operator.reconcile.evaluation import Evaluation
from finetune_operator.reconcile.workload_patches import (
    WAIT_FOR_START,
    finalizer_adopt_patch,
    finalizer_release_patch,
    finish_patch,
    pods_ready_patch,
    pods_ready_reason,
    release_patch,
)
from finetune_operator.resources.workload import (
    KUEUE_API_VERSION,
    WORKLOAD_KIND,
    WORKLOAD_PLURAL,
    build_workload,
    workload_name,
)


def workload_to_write(ev: Evaluation) -> dict[str, Any] | None:
    """The Workload to write: when it does not exist yet, or its `active` is not what the
    job wants (false while suspended). Otherwise nothing: its podSets are immutable."""
    q = ev.queue
    if q is None or ev.spec is None or ev.plan is None or q.foreign or q.left or q.deleting:
        return None
    if q.unreadable:
        return None  # only one known absent is created: the write would be refused alike
    if q.raw is None and q.priority_problem:
        return None  # created once its priority can be read: Kueue cannot change it later
    wanted = build_workload(ev.job.owner, ev.spec, ev.plan, q.queue, q.priority)
    if (q.stale or q.moved) and not q.quota_reserved:
        return wanted  # rewritten (Actions.workload_rewrite)
    if (
        q.raw is not None
        and (q.raw.get("spec") or {}).get("active", True) == wanted["spec"]["active"]
    ):
        return None
    return wanted


def workload_removal(ev: Evaluation, a: Assessment) -> tuple[ObjectRef, ...]:
    """The Workload deleted once the job's pods are gone (its quota goes with it): a stale
    one that holds quota (Kueue forbids changing podSets while reserved; the next pass
    creates it anew, as Kueue's job reconciler does with a Workload no longer equivalent to
    its job), or the Workload of a job whose queue-name label was removed (it leaves Kueue)."""
    q = ev.queue
    if q is None or q.deleting or q.unknown or a.terminating or a.live_pods:
        return ()
    if not (q.left or (q.stale and q.quota_reserved)):
        return ()
    return (
        ObjectRef(KUEUE_API_VERSION, WORKLOAD_KIND, WORKLOAD_PLURAL, workload_name(ev.job.owner)),
    )


def pods_ready(ev: Evaluation, a: Assessment, now: datetime) -> dict[str, Any] | None:
    """The Workload's PodsReady, written when it changes (Kueue's waitForPodsReady reads it)."""
    q = ev.queue
    if q is None or q.raw is None:
        return None
    ready = a.desired > 0 and a.ready >= a.desired
    if q.pods_ready is ready:
        return None
    return pods_ready_patch(
        q.raw, ready, pods_ready_reason(ready, q.pods_ready, q.pods_ready_reason), now
    )


def release(ev: Evaluation, a: Assessment, now: datetime) -> dict[str, Any] | None:
    """An evicted (or deactivated) Workload's quota is given back once every pod is gone:
    Kueue requeues it then, and admits it again when there is room. A Workload found no
    longer admitted with its PodsReady still True has that set False."""
    q = ev.queue
    if q is None or q.raw is None or q.left or q.deleting:  # deleted instead
        return None
    if q.evicted is None or not q.quota_reserved:
        # Not admitted (any more) without it being this pass's doing: PodsReady is False
        # then, as Kueue's job reconciler keeps it (release_patch says why).
        if q.pods_ready and not q.quota_reserved and not q.foreign:
            return pods_ready_patch(q.raw, False, WAIT_FOR_START, now)
        return None
    if a.terminating or a.live_pods:
        return None
    return release_patch(q.raw, q.evicted_message or q.evicted, now)


def finalizer(ev: Evaluation, a: Assessment) -> dict[str, Any] | None:
    """The resource-in-use finalizer comes off once the quota may go: the Workload Finished
    (as read: the pass that marks it waits for the next) or being deleted, and no pod of the
    job still running or going away (finished workers kept for their logs hold nothing).
    A Workload that holds quota without it (written before the operator set it at creation)
    gets it, so that its deletion waits for the pods like any other's; not once the job is
    over (Finished is being written: the quota goes anyway)."""
    q = ev.queue
    if q is None or q.raw is None or q.foreign:
        return None
    if not (q.finished or q.deleting):
        adopt = q.quota_reserved and not q.left and a.mode not in (Mode.SUCCEEDED, Mode.FAILED)
        return finalizer_adopt_patch(q.raw) if adopt else None
    if a.terminating or any(p.active for p in a.live_pods):
        return None
    return finalizer_release_patch(q.raw)


def awaits_pods_gone(ev: Evaluation, a: Assessment) -> bool:
    """Whether a step on the job's Workload waits for pods this pass leaves going away (not
    finished workers kept for their logs): the quota given back after an eviction or a
    suspend, the Workload deleted (its label removed, or stale), its finalizer removed."""
    q = ev.queue
    if q is None or q.raw is None or q.foreign:
        return False
    done = a.mode is Mode.SUCCEEDED
    going = [p for p in a.live_pods if not done or p.is_rendezvous or p.active]
    return bool(a.terminating or going)


def finish(ev: Evaluation, a: Assessment, now: datetime) -> dict[str, Any] | None:
    q = ev.queue
    if q is None or q.raw is None or q.finished:
        return None
    reason = FAILED_TO_START if a.failure_reason == FAILED_TO_START else ""
    return finish_patch(q.raw, a.mode is Mode.SUCCEEDED, a.message or "", now, reason)
