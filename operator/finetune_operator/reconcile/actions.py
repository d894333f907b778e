"""decide_actions: the objects to create and the pods to delete (pure, `now` passed in)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from finetune_operator.api.constants import (
    ANNOTATION_RESTART_ATTEMPT,
    LABEL_ROLE,
    REASON_COMPLETED,
    REASON_INVALID_SPEC,
    REASON_PREEMPTED,
    REASON_RESTARTING,
    REASON_SUSPENDED,
    ROLE_WORKER,
)
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile.admission import FAILED_TO_START
from finetune_operator.reconcile.assess import Assessment, Mode, assess, queued_reason
from finetune_operator.reconcile.budget import closes_rendezvous, in_pod_budget
from finetune_operator.reconcile.conditions import EventSpec
from finetune_operator.reconcile.disposition import Disposition
from finetune_operator.reconcile.evaluation import Evaluation
from finetune_operator.reconcile.observed import PodView
from finetune_operator.reconcile.workload_patches import (
    WAIT_FOR_START,
    finalizer_adopt_patch,
    finalizer_release_patch,
    finish_patch,
    pods_ready_patch,
    pods_ready_reason,
    release_patch,
)
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
from finetune_operator.resources.workload import (
    KUEUE_API_VERSION,
    WORKLOAD_KIND,
    WORKLOAD_PLURAL,
    build_workload,
    place_worker,
    workload_name,
)


@dataclass(frozen=True)
class PodDeletion:
    name: str
    uid: str  # a precondition: never delete a replacement that reused the name
    reason: str
    grace_seconds: int | None = None  # None: the pod's own terminationGracePeriodSeconds


@dataclass(frozen=True)
class ObjectRef:
    """A custom object to delete (the PodGroup of a suspended or finished job)."""

    api_version: str
    kind: str
    plural: str
    name: str


@dataclass(frozen=True)
class Actions:
    """What the apply layer must do, in this order: ensure, delete, create."""

    ensure: tuple[dict[str, Any], ...] = ()  # create, or update if it differs (ConfigMap, Services)
    delete: tuple[PodDeletion, ...] = ()
    create: tuple[dict[str, Any], ...] = ()  # create if absent (pods)
    events: tuple[EventSpec, ...] = ()
    # Gang scheduling: the PodGroup, ensured before any pod is created; no worker pod is
    # created in a pass where it could not be (a worker outside its group would be placed
    # alone, or never: exactly what the group is for).
    pod_group: dict[str, Any] | None = None
    remove: tuple[ObjectRef, ...] = ()  # deleted (absent is fine)
    # Kueue: the job's Workload to create (or whose `active` to set), ensured first: no pod
    # is created in a pass where it could not be; and a merge patch of its status (the quota
    # given back after an eviction, or Finished).
    workload: dict[str, Any] | None = None
    # and rewrite its podSets and queueName (written for an earlier spec or queue label; only
    # while it holds no quota)
    workload_rewrite: bool = False
    workload_status: dict[str, Any] | None = None
    workload_name: str = ""
    # A merge patch of the Workload's metadata that removes the resource-in-use finalizer
    # (the Workload Finished or being deleted, and no pod of the job running any more), or
    # adds it (a Workload holding quota without it, written before the operator set it).
    workload_finalizer: dict[str, Any] | None = None
    # Set the existing Workload's `active` false (the job's spec became invalid: no Workload
    # can be built, and the one admitted must give its quota back).
    workload_deactivate: bool = False
    # Not an action: Kueue's side of the job waits for its pods to be gone (the quota given
    # back, the Workload deleted or its finalizer removed), so the handler runs the next pass
    # when one is deleted, not a reconcile interval later (handlers.workloads).
    await_pods_gone: bool = False

    @property
    def empty(self) -> bool:
        return not (
            self.ensure or self.delete or self.create or self.pod_group or self.remove
            or self.workload or self.workload_status or self.workload_deactivate
            or self.workload_finalizer
        )  # fmt: skip


def _deletions(pods: Sequence[PodView], reason: str) -> tuple[PodDeletion, ...]:
    return tuple(PodDeletion(p.name, p.uid, reason) for p in pods)


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
        workload=_workload(ev) if not a.hold else None,
        workload_status=_pods_ready(ev, a, now),
        workload_name=workload_name(ev.job.owner),
        workload_finalizer=_finalizer(ev, a),
    )


def _workload(ev: Evaluation) -> dict[str, Any] | None:
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


def _workload_removal(ev: Evaluation, a: Assessment) -> tuple[ObjectRef, ...]:
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


def _pods_ready(ev: Evaluation, a: Assessment, now: datetime) -> dict[str, Any] | None:
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


def _release(ev: Evaluation, a: Assessment, now: datetime) -> dict[str, Any] | None:
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


def _finalizer(ev: Evaluation, a: Assessment) -> dict[str, Any] | None:
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


def _awaits_pods_gone(ev: Evaluation, a: Assessment) -> bool:
    """Whether a step on the job's Workload waits for pods this pass leaves going away (not
    finished workers kept for their logs): the quota given back after an eviction or a
    suspend, the Workload deleted (its label removed, or stale), its finalizer removed."""
    q = ev.queue
    if q is None or q.raw is None or q.foreign:
        return False
    done = a.mode is Mode.SUCCEEDED
    going = [p for p in a.live_pods if not done or p.is_rendezvous or p.active]
    return bool(a.terminating or going)


def _finish(ev: Evaluation, a: Assessment, now: datetime) -> dict[str, Any] | None:
    q = ev.queue
    if q is None or q.raw is None or q.finished:
        return None
    reason = FAILED_TO_START if a.failure_reason == FAILED_TO_START else ""
    return finish_patch(q.raw, a.mode is Mode.SUCCEEDED, a.message or "", now, reason)


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
) -> Actions:
    """Actions that move the cluster toward the job's desired state.

    `status` is the status *before* compute_status (both read the same inputs, so they agree);
    `ensured_generation` is the generation whose ConfigMap and Services were last applied
    (None: unknown, apply them again - harmless, an update with the same content).
    Idempotent: on a state that already has every object it returns no creates. `own`: what
    this pass scraped of the pods' failed rounds (assess.assess).
    """
    a = assess(ev, status, pods, now, own)
    if a.mode is Mode.ACTIVE:
        return _active(ev, status, a, ensured_generation, now)
    if a.mode is Mode.SUCCEEDED:
        # The store is no longer needed; finished workers stay for their logs.
        leftovers = [p for p in a.live_pods if p.is_rendezvous or p.active]
        return Actions(
            delete=_deletions(leftovers, REASON_COMPLETED),
            remove=_pod_group_removal(ev, a),
            workload_status=_finish(ev, a, now),
            workload_name=workload_name(ev.job.owner),
            workload_finalizer=_finalizer(ev, a),
            await_pods_gone=_awaits_pods_gone(ev, a),
        )
    reason = {
        Mode.SUSPENDED: REASON_SUSPENDED,
        Mode.QUEUED: queued_reason(ev),
        Mode.FAILED: a.failure_reason,
        Mode.INVALID: ev.failure_reason or REASON_INVALID_SPEC,
    }[a.mode]
    status_patch = _finish(ev, a, now) if a.mode is Mode.FAILED else _release(ev, a, now)
    workload = _workload(ev) if a.mode in (Mode.SUSPENDED, Mode.QUEUED) else None
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
        await_pods_gone=_awaits_pods_gone(ev, a),
        delete=_deletions(a.live_pods, reason),
        remove=_pod_group_removal(ev, a) + _workload_removal(ev, a),
        workload=workload,
        workload_rewrite=workload is not None
        and ev.queue is not None
        and (ev.queue.stale or ev.queue.moved),
        workload_status=status_patch,
        workload_name=workload_name(ev.job.owner),
        workload_deactivate=deactivate,
        workload_finalizer=_finalizer(ev, a),
    )
