"""decide_actions: the objects to create and the pods to delete (pure, `now` passed in)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from finetune_operator.api.constants import (
    ANNOTATION_RESTART_ATTEMPT,
    LABEL_ROLE,
    REASON_COMPLETED,
    REASON_INVALID_SPEC,
    REASON_NODE_LOST,
    REASON_PREEMPTED,
    REASON_RESTARTING,
    REASON_SUSPENDED,
    ROLE_WORKER,
)
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile.action_types import Actions, ObjectRef, PodDeletion
from finetune_operator.reconcile.assess import Assessment, Mode, assess, queued_reason
from finetune_operator.reconcile.budget import closes_rendezvous, in_pod_budget
from finetune_operator.reconcile.conditions import EventSpec
from finetune_operator.reconcile.disposition import Disposition
from finetune_operator.reconcile.evaluation import Evaluation
from finetune_operator.reconcile.kueue_actions import (
    awaits_pods_gone,
    finalizer,
    finish,
    pods_ready,
    release,
    workload_removal,
    workload_to_write,
)
from finetune_operator.reconcile.nodeloss import NodeReading
from finetune_operator.reconcile.observed import PodView
from finetune_operator.resources import (
    build_job_pod_group,
    build_rendezvous_pod,
    build_shared_objects,
    build_worker_pod,
    gang_of,
    pod_group_name,
)
from finetune_operator.resources.podgroup import KIND as POD_GROUP_KIND
from finetune_operator.resources.podgroup import PLURAL as POD_GROUP_PLURAL
from finetune_operator.resources.workload import place_worker, workload_name

__all__ = ["Actions", "ObjectRef", "PodDeletion", "decide_actions"]


def _deletions(pods: Sequence[PodView], reason: str) -> tuple[PodDeletion, ...]:
    return tuple(PodDeletion(p.name, p.uid, reason) for p in pods)


def _force_deletions(a: Assessment) -> tuple[PodDeletion, ...]:
    """Pods lost with their node (nodeloss.py): no kubelet will finish their graceful
    deletion, so they go at once (grace 0), and their slots free; again for those whose
    earlier force delete is not seen done (counted then, not now)."""
    pods = [*(x.pod for x in a.lost), *a.lost_again]
    return tuple(PodDeletion(p.name, p.uid, REASON_NODE_LOST, 0) for p in pods)


def _lost_events(a: Assessment) -> tuple[EventSpec, ...]:
    return tuple(EventSpec("Warning", REASON_NODE_LOST, x.describe()) for x in a.lost)


def _create_pods(ev: Evaluation, status: FineTuneJobStatus, a: Assessment) -> list[dict[str, Any]]:
    assert ev.spec is not None and ev.plan is not None
    owner = ev.job.owner
    # The job's failure restarts when the pod is made: where its torchrun's own restarts
    # start on the job's count (budget.py); it also tells a replacement from the original.
    notes = {ANNOTATION_RESTART_ATTEMPT: str(a.restarts)}
    # torchrun in the pod may restart its workers only as often as the job has budget left.
    in_pod = in_pod_budget(ev.spec.fault_tolerance.max_restarts, a.restarts)
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
    for index in range(a.desired):
        pod = build_worker_pod(
            owner,
            ev.spec,
            ev.plan,
            index,
            excluded_nodes=list(status.excluded_nodes),
            annotations=notes,
            max_restarts=in_pod,
        )
        if ev.queue is not None:
            pod = place_worker(pod, ev.queue.placement)
        if index not in a.workers and pod["metadata"]["name"] not in a.terminating:
            out.append(pod)
    return out


def _active(
    ev: Evaluation,
    status: FineTuneJobStatus,
    a: Assessment,
    ensured_generation: int | None,
    now: datetime,
) -> Actions:
    assert ev.spec is not None and ev.plan is not None
    ensure: tuple[dict[str, Any], ...] = ()
    if ensured_generation != ev.job.generation:
        ensure = tuple(
            build_shared_objects(ev.job.owner, ev.spec, ev.plan, network_policy=ev.network_policy)
        )
    surplus = [p for i, p in a.workers.items() if i >= a.desired]
    preempted = [p for p, _ in a.preempted_now]
    # A pod whose torchrun gave up has shut the job's rendezvous down for good: no agent can
    # join it again, so the store is replaced with the pod (the workers that lose it end
    # RendezvousLost: replaced, not counted).
    closed: list[PodView] = []
    gave_up = any(closes_rendezvous(p) for p in a.replace_now if p.is_worker) or any(
        v.disposition is Disposition.RENDEZVOUS_CLOSED for _, v in a.preempted_now
    )
    if gave_up and a.rendezvous is not None and a.rendezvous not in preempted:
        closed.append(a.rendezvous)
    deletes = (
        _deletions(a.replace_now, REASON_RESTARTING)
        + _deletions(closed, REASON_RESTARTING)
        + _deletions(preempted, REASON_PREEMPTED)
        + _deletions(surplus, REASON_COMPLETED)
    )
    # A slot being replaced is still occupied this round; its pod is created on the next pass,
    # once the old one is gone (same name).
    going = {p.name for p in (*a.replace_now, *preempted, *closed)}
    # A lost pod is gone once force-deleted (the apply deletes before it creates): its slot
    # is filled in this same pass (if the delete fails, the create finds the name taken).
    gone = {x.pod.name for x in a.lost} | {p.name for p in a.lost_again}
    remaining = replace(
        a,
        workers={i: p for i, p in a.workers.items() if p.name not in going},
        rendezvous=None if a.rendezvous and a.rendezvous.name in going else a.rendezvous,
        terminating=(a.terminating - gone) | going,
    )
    budget = ev.spec.fault_tolerance.max_restarts
    events = tuple(
        EventSpec(
            "Warning",
            REASON_RESTARTING,
            f"{p.describe_failure()}; replacing it ({a.restarts} of {budget} restarts used)",
        )
        for p in a.replace_now
    ) + tuple(
        EventSpec(
            "Normal",
            v.disposition.value,
            f"pod {p.name} ended: {v.why}; replacing it (not counted against maxRestarts)",
        )
        for p, v in a.preempted_now
    )
    # While Kueue's admission cannot be read, the workers that run are kept but none is added.
    create = tuple(_create_pods(ev, status, remaining)) if not a.hold else ()
    # The PodGroup with each new generation, and again whenever pods are to be created (one
    # deleted by hand would otherwise leave the new pods waiting for a group that never comes).
    pod_group = None
    if ensure or any(p["metadata"]["labels"].get(LABEL_ROLE) == ROLE_WORKER for p in create):
        pod_group = build_job_pod_group(ev.job.owner, ev.spec, ev.plan)
    return Actions(
        ensure=ensure,
        delete=deletes,
        create=create,
        events=events,
        pod_group=pod_group,
        workload=workload_to_write(ev) if not a.hold else None,
        workload_status=pods_ready(ev, a, now),
        workload_name=workload_name(ev.job.owner),
        workload_finalizer=finalizer(ev, a),
    )


def _pod_group_removal(ev: Evaluation, a: Assessment) -> tuple[ObjectRef, ...]:
    """A suspended or finished job gives its PodGroup back (Volcano counts a group's
    minResources against its queue while it exists), as Kubeflow's training operator does; a
    resumed job gets a fresh one. Only while its pods are still going away, so a finished
    job does not delete a long-gone group on every pass."""
    found = gang_of(ev.spec) if ev.spec is not None else None
    if found is None or not (a.terminating or any(p.active for p in a.live_pods)):
        return ()
    api = found[1]
    name = pod_group_name(ev.job.owner)
    return (ObjectRef(api.api_version, POD_GROUP_KIND, POD_GROUP_PLURAL, name),)


def decide_actions(
    ev: Evaluation,
    status: FineTuneJobStatus,
    pods: Sequence[PodView],
    now: datetime,
    *,
    ensured_generation: int | None = None,
    own: Mapping[str, frozenset[str]] | None = None,
    nodes: NodeReading | None = None,
) -> Actions:
    """Actions that move the cluster toward the job's desired state.

    `status` is the status *before* compute_status (both read the same inputs, so they agree);
    `ensured_generation` is the generation whose ConfigMap and Services were last applied
    (None: unknown, apply them again - harmless, an update with the same content).
    Idempotent: on a state that already has every object it returns no creates. `own`: what
    this pass scraped of the pods' failed rounds (assess.assess); `nodes`: the Nodes of the
    terminating pods as read this pass (nodeloss.py).
    """
    a = assess(ev, status, pods, now, own, nodes)
    # Lost pods go in every mode, first (the apply deletes before it creates: an active job
    # fills their slots in this pass); in a job not active any more (suspended, finished,
    # queued) a Workload's quota and a PodGroup are held until its pods are gone.
    if a.mode is Mode.ACTIVE:
        actions = _active(ev, status, a, ensured_generation, now)
    else:
        actions = _inactive(ev, a, now)
    return replace(
        actions,
        delete=_force_deletions(a) + actions.delete,
        events=_lost_events(a) + actions.events,
    )


def _inactive(ev: Evaluation, a: Assessment, now: datetime) -> Actions:
    if a.mode is Mode.SUCCEEDED:
        # The store is no longer needed; finished workers stay for their logs.
        leftovers = [p for p in a.live_pods if p.is_rendezvous or p.active]
        return Actions(
            delete=_deletions(leftovers, REASON_COMPLETED),
            remove=_pod_group_removal(ev, a),
            workload_status=finish(ev, a, now),
            workload_name=workload_name(ev.job.owner),
            workload_finalizer=finalizer(ev, a),
            await_pods_gone=awaits_pods_gone(ev, a),
        )
    reason = {
        Mode.SUSPENDED: REASON_SUSPENDED,
        Mode.QUEUED: queued_reason(ev),
        Mode.FAILED: a.failure_reason,
        Mode.INVALID: ev.failure_reason or REASON_INVALID_SPEC,
    }[a.mode]
    status_patch = finish(ev, a, now) if a.mode is Mode.FAILED else release(ev, a, now)
    workload = workload_to_write(ev) if a.mode in (Mode.SUSPENDED, Mode.QUEUED) else None
    q = ev.queue
    # An invalid spec will not run until it is edited: its Workload is deactivated, as a
    # suspend does, so Kueue evicts it and the quota goes back (released below once the
    # pods are gone); editing the spec valid again reactivates it (_workload). Not Finished:
    # Kueue never admits a finished Workload again, and the job is not over.
    deactivate = (
        a.mode is Mode.INVALID and q is not None and q.raw is not None and not q.foreign
        and not q.finished and (q.raw.get("spec") or {}).get("active", True) is not False
    )  # fmt: skip
    return Actions(
        await_pods_gone=awaits_pods_gone(ev, a),
        delete=_deletions(a.live_pods, reason),
        remove=_pod_group_removal(ev, a) + workload_removal(ev, a),
        workload=workload,
        workload_rewrite=workload is not None
        and ev.queue is not None
        and (ev.queue.stale or ev.queue.moved),
        workload_status=status_patch,
        workload_name=workload_name(ev.job.owner),
        workload_deactivate=deactivate,
        workload_finalizer=finalizer(ev, a),
    )
