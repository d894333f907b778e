"""Kueue glue: the job's Workload read for a pass, Workload events (and the deletion of the
pods a Workload step waits on) nudging the job's timer, and the resource-in-use finalizer
freed for a job that is gone."""

from __future__ import annotations

import time
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from finetune_operator.api.constants import GROUP, KIND, LABEL_JOB, VERSION
from finetune_operator.reconcile import JobRef
from finetune_operator.reconcile.admission import (
    QueueState,
    flavors_assigned,
    read_left_queue_state,
    read_queue_state,
)
from finetune_operator.reconcile.apply import ClusterApi
from finetune_operator.resources.workload import (
    KUEUE_GROUP,
    KUEUE_VERSION,
    RESOURCE_IN_USE,
    WORKLOAD_PLURAL,
    priority_ref,
    workload_name,
)

JobKey = tuple[str | None, str | None]  # (namespace, name)
# A nudge not taken within this long belongs to a job that is gone (every job's timer ticks
# each second): dropped, so the set never grows with deleted jobs. A Workload event can
# reach the operator after its job's delete handler forgot the job (the finalizer it
# removed, garbage collection), and nothing else would ever take it. A live job whose
# nudge is dropped (a pass stuck that long) loses nothing: its interval still runs it.
NUDGE_TTL_SECONDS = 60.0


def _nudged(memo: kopf.Memo) -> dict[JobKey, float]:
    # In the root memo (handlers.jobs.configure), which every object's memo copies shallowly:
    # one dict shared by all handlers. Every handler touching it runs in kopf's event loop
    # (async) and never awaits between reading and changing it: no lock needed.
    nudged: dict[JobKey, float] = memo.setdefault("nudged", {})
    return nudged


def nudge(memo: kopf.Memo, key: JobKey, now: float) -> None:
    """The job's pass is due at its next timer tick (`now`: monotonic seconds)."""
    nudged = _nudged(memo)
    for stale in [k for k, at in nudged.items() if now - at > NUDGE_TTL_SECONDS]:
        del nudged[stale]
    nudged[key] = now


def take_nudge(memo: kopf.Memo, key: JobKey) -> bool:
    """Whether the job's pass is due now (its Workload changed); the nudge is consumed."""
    return _nudged(memo).pop(key, None) is not None


def forget_nudge(memo: kopf.Memo, key: JobKey) -> None:
    """The job is deleted: no timer of its will take its nudge, no pod of its is awaited."""
    _nudged(memo).pop(key, None)
    _awaiting(memo).discard(key)


def _awaiting(memo: kopf.Memo) -> set[JobKey]:
    # Shared like "nudged" (handlers.jobs.configure creates both in the root memo).
    awaiting: set[JobKey] = memo.setdefault("awaiting_pods", set())
    return awaiting


def await_pods_gone(memo: kopf.Memo, key: JobKey, waiting: bool) -> None:
    """Whether a pass of the job waits for its pods to be gone (Actions.await_pods_gone): the
    deletion of one then nudges its pass (job_pod_deleted)."""
    if waiting:
        _awaiting(memo).add(key)
    else:
        _awaiting(memo).discard(key)


@kopf.on.event("v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def job_pod_deleted(namespace: str | None, body: kopf.Body, memo: Any, **kw: Any) -> None:
    """A job's pod is gone: if a step on its Workload waits for that (the quota given back,
    the Workload deleted after its queue-name label was removed, its finalizer removed), the
    job's pass runs at the next timer tick rather than a reconcile interval later. Other
    pod events change nothing here: the pods index carries them to the next pass."""
    if kw.get("type") != "DELETED":
        return
    key: JobKey = (namespace, (body.get("metadata", {}).get("labels") or {}).get(LABEL_JOB))
    if key in _awaiting(memo):
        nudge(memo, key, time.monotonic())


async def queue_state(cluster: ClusterApi, job: JobRef, body: kopf.Body) -> QueueState | None:
    """The job's standing in Kueue (its Workload and the flavors it was admitted to, or the
    priority its Workload is to be created with); None for a job not queued in Kueue."""
    if job.queue_name is None:
        return await _left_queue_state(cluster, job, body)
    workload, unreadable = await cluster.read_workload(job.namespace, workload_name(job.owner))
    if unreadable:
        return read_queue_state(job.queue_name, None, {}, unreadable=unreadable)
    if workload is not None:
        flavors = await cluster.read_flavors(flavors_assigned(workload))
        return read_queue_state(job.queue_name, workload, flavors, owner_uid=job.uid)
    pods_class = ((body.get("spec") or {}).get("resources") or {}).get("priorityClassName")
    ref = priority_ref(body.get("metadata", {}).get("labels"), pods_class)
    if ref is None:
        return read_queue_state(job.queue_name, None, {})
    value, problem = await cluster.read_priority(ref)
    priority = (ref, value) if value is not None else None
    return read_queue_state(job.queue_name, None, {}, priority=priority, priority_problem=problem)


async def _left_queue_state(cluster: ClusterApi, job: JobRef, body: kopf.Body) -> QueueState | None:
    """A job without the queue-name label that had a Workload (status.workload, written while
    it was queued): its Workload, if still there, is given back (admission.QueueState.left).
    A job never queued costs no API call. Kueue uninstalled (Workloads not served): no
    Workload is left, the job runs without it; one that cannot be read otherwise is kept in
    mind (read_left_queue_state)."""
    if not (body.get("status") or {}).get("workload"):
        return None
    name = workload_name(job.owner)
    workload, unreadable = await cluster.read_workload(job.namespace, name, unserved_is_absent=True)
    return read_left_queue_state(workload, job.uid, unreadable=unreadable)


async def release_deleted_job_workload(
    cluster: ClusterApi, job: JobRef, body: kopf.Body, logger: kopf.Logger
) -> None:
    """The deleted job's Workload loses its resource-in-use finalizer (as Kueue's job
    reconciler drops it once the job is gone), or garbage collection would wait on it forever."""
    if not (job.queue_name or (body.get("status") or {}).get("workload")):
        return
    try:
        await cluster.release_workload(job.namespace, workload_name(job.owner), job.uid)
    except ApiException as err:
        logger.warning("Workload %s keeps its finalizer: %s", workload_name(job.owner), err.reason)


def owner_job(body: kopf.Body | dict[str, Any]) -> dict[str, Any] | None:
    """The FineTuneJob ownerReference of a Workload (None: not one of ours)."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion") == f"{GROUP}/{VERSION}":
            found: dict[str, Any] = dict(ref)
            return found
    return None


def _owned_by_a_job(body: kopf.Body, **_: Any) -> bool:
    return owner_job(body) is not None


# Kueue's CRDs not installed: kopf warns that the resource cannot be served and watches the
# rest (and starts watching once the CRD appears). On.event, not an index: an index kopf
# cannot fill (no permission to list Workloads) would hold every handler back.
@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, WORKLOAD_PLURAL, labels={LABEL_JOB: kopf.PRESENT}, when=_owned_by_a_job)  # fmt: skip
async def workload_changed(namespace: str | None, body: kopf.Body, memo: Any, logger: kopf.Logger, **kw: Any) -> None:  # fmt: skip
    """Kueue admitted, evicted or finished a job's Workload: the job's pass runs at the next
    timer tick, not up to a reconcile interval later. A Workload being deleted whose job is
    gone (its delete handler missed, the operator down then) loses its finalizer here."""
    owner = owner_job(body)
    assert owner is not None  # when=
    gone = kw.get("type") == "DELETED"  # the last state: deletionTimestamp only if it was held
    key: JobKey = (namespace, owner.get("name"))
    meta = body.get("metadata", {})
    if not meta.get("deletionTimestamp") and not gone:
        nudge(memo, key, time.monotonic())
        return
    # Going (garbage collection after the job's deletion, most often): nudge only a job that
    # is still there, or its key would stay in the set for good (its timer is gone).
    cluster: ClusterApi = memo["cluster"]
    try:
        if await cluster.job_exists(namespace or "", owner.get("name", ""), owner.get("uid", "")):
            nudge(memo, key, time.monotonic())
        elif not gone and RESOURCE_IN_USE in (meta.get("finalizers") or []):
            await cluster.release_workload(
                namespace or "", meta.get("name", ""), owner.get("uid", "")
            )
    except ApiException as err:
        nudge(
            memo, key, time.monotonic()
        )  # the job's own pass decides; a leaked key costs one early pass
        logger.warning("Workload %s keeps its finalizer: %s", meta.get("name"), err.reason)
