"""decide_actions: the objects to create and the pods to delete (pure, `now` passed in)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from finetune_operator.api.constants import (
    ANNOTATION_RESTART_ATTEMPT,
    REASON_COMPLETED,
    REASON_INVALID_SPEC,
    REASON_PREEMPTED,
    REASON_RESTARTING,
    REASON_SUSPENDED,
)
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile.assess import Assessment, Mode, assess
from finetune_operator.reconcile.conditions import EventSpec
from finetune_operator.reconcile.evaluation import Evaluation
from finetune_operator.reconcile.observed import PodView
from finetune_operator.resources import (
    build_rendezvous_pod,
    build_shared_objects,
    build_worker_pod,
)


@dataclass(frozen=True)
class PodDeletion:
    name: str
    uid: str  # a precondition: never delete a replacement that reused the name
    reason: str
    grace_seconds: int | None = None  # None: the pod's own terminationGracePeriodSeconds


@dataclass(frozen=True)
class Actions:
    """What the apply layer must do, in this order: ensure, delete, create."""

    ensure: tuple[dict[str, Any], ...] = ()  # create, or update if it differs (ConfigMap, Services)
    delete: tuple[PodDeletion, ...] = ()
    create: tuple[dict[str, Any], ...] = ()  # create if absent (pods)
    events: tuple[EventSpec, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.ensure or self.delete or self.create)


def _deletions(pods: Sequence[PodView], reason: str) -> tuple[PodDeletion, ...]:
    return tuple(PodDeletion(p.name, p.uid, reason) for p in pods)


def _create_pods(ev: Evaluation, status: FineTuneJobStatus, a: Assessment) -> list[dict[str, Any]]:
    assert ev.spec is not None and ev.plan is not None
    owner = ev.job.owner
    # The attempt number lets anyone reading the pod tell a replacement from the original.
    notes = {ANNOTATION_RESTART_ATTEMPT: str(a.restarts)}
    out: list[dict[str, Any]] = []
    rdzv_name = build_rendezvous_pod(owner, ev.spec)["metadata"]["name"]
    if a.rendezvous is None and rdzv_name not in a.terminating:
        out.append(build_rendezvous_pod(owner, ev.spec, annotations=notes))
    if a.any_worker_succeeded:
        return out  # training finished: never start a new worker into a completed group
    if rdzv_name in a.terminating:
        # Store first: a worker created now would start against the store that is going away
        # (and its end could not be told from a failure: disposition.py).
        return out
    for index in range(ev.plan.nodes):
        pod = build_worker_pod(
            owner,
            ev.spec,
            ev.plan,
            index,
            excluded_nodes=list(status.excluded_nodes),
            annotations=notes,
        )
        if index not in a.workers and pod["metadata"]["name"] not in a.terminating:
            out.append(pod)
    return out


def _active(
    ev: Evaluation, status: FineTuneJobStatus, a: Assessment, ensured_generation: int | None
) -> Actions:
    assert ev.spec is not None and ev.plan is not None
    ensure: tuple[dict[str, Any], ...] = ()
    if ensured_generation != ev.job.generation:
        ensure = tuple(
            build_shared_objects(ev.job.owner, ev.spec, ev.plan, network_policy=ev.network_policy)
        )
    surplus = [p for i, p in a.workers.items() if i >= ev.plan.nodes]
    preempted = [p for p, _ in a.preempted_now]
    deletes = (
        _deletions(a.replace_now, REASON_RESTARTING)
        + _deletions(preempted, REASON_PREEMPTED)
        + _deletions(surplus, REASON_COMPLETED)
    )
    # A slot being replaced is still occupied this round; its pod is created on the next pass,
    # once the old one is gone (same name).
    going = {p.name for p in (*a.replace_now, *preempted)}
    remaining = replace(
        a,
        workers={i: p for i, p in a.workers.items() if p.name not in going},
        rendezvous=None if a.rendezvous and a.rendezvous.name in going else a.rendezvous,
        terminating=a.terminating | going,
    )
    budget = ev.spec.fault_tolerance.max_restarts
    events = tuple(
        EventSpec(
            "Warning",
            REASON_RESTARTING,
            f"{p.describe_failure()}; replacement {status.restarts + n} of {budget}",
        )
        for n, p in enumerate(a.replace_now, start=1)
    ) + tuple(
        EventSpec(
            "Normal",
            v.disposition.value,
            f"pod {p.name} ended: {v.why}; replacing it (not counted against maxRestarts)",
        )
        for p, v in a.preempted_now
    )
    return Actions(
        ensure=ensure,
        delete=deletes,
        create=tuple(_create_pods(ev, status, remaining)),
        events=events,
    )


def decide_actions(
    ev: Evaluation,
    status: FineTuneJobStatus,
    pods: Sequence[PodView],
    now: datetime,
    *,
    ensured_generation: int | None = None,
) -> Actions:
    """Actions that move the cluster toward the job's desired state.

    `status` is the status *before* compute_status (both read the same inputs, so they agree);
    `ensured_generation` is the generation whose ConfigMap and Services were last applied
    (None: unknown, apply them again - harmless, an update with the same content).
    Idempotent: on a state that already has every object it returns no creates.
    """
    a = assess(ev, status, pods, now)
    if a.mode is Mode.ACTIVE:
        return _active(ev, status, a, ensured_generation)
    if a.mode is Mode.SUCCEEDED:
        # The store is no longer needed; finished workers stay for their logs.
        leftovers = [p for p in a.live_pods if p.is_rendezvous or p.active]
        return Actions(delete=_deletions(leftovers, REASON_COMPLETED))
    reason = {
        Mode.SUSPENDED: REASON_SUSPENDED,
        Mode.FAILED: a.failure_reason,
        Mode.INVALID: ev.failure_reason or REASON_INVALID_SPEC,
    }[a.mode]
    return Actions(delete=_deletions(a.live_pods, reason))
