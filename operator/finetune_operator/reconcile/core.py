"""One pure reconcile pass: evaluation → status → actions → events, and the status patch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from finetune_operator.api.constants import COND_PLANNED, REASON_DEPRECATED_SPEC
from finetune_operator.api.policy import JobPolicy
from finetune_operator.api.spec_compat import describe_deprecations
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile.actions import Actions, decide_actions
from finetune_operator.reconcile.admission import QueueState, pod_sets_differ
from finetune_operator.reconcile.conditions import EventSpec, condition_events, find
from finetune_operator.reconcile.evaluation import Evaluation, JobRef, PlanFn, evaluate_job
from finetune_operator.reconcile.health import HealthInput, assess_health
from finetune_operator.reconcile.nodeloss import NodeReading
from finetune_operator.reconcile.observed import PodView, mark_terminating
from finetune_operator.reconcile.queue_label import judge_queue_label, note_queue_label
from finetune_operator.reconcile.samples import RecordBuffer
from finetune_operator.reconcile.status import compute_status
from finetune_operator.resources.worker import build_worker_pod
from finetune_operator.resources.workload import build_workload, placement_conflict


@dataclass(frozen=True)
class Outcome:
    evaluation: Evaluation
    status: FineTuneJobStatus
    actions: Actions
    events: tuple[EventSpec, ...]
    buffer: RecordBuffer | None = None  # the straggler detector's input, for the next pass
    ratios: dict[int, float] = field(default_factory=dict)  # latest window's ratio per rank


def read_status(raw: Mapping[str, Any] | None) -> FineTuneJobStatus:
    """Our status from the object; fields we do not own (or a mangled status) are dropped."""
    known = set(FineTuneJobStatus.model_fields) | {
        f.alias for f in FineTuneJobStatus.model_fields.values() if f.alias
    }
    mine = {k: v for k, v in (raw or {}).items() if k in known}
    try:
        return FineTuneJobStatus.model_validate(mine)
    except ValidationError:
        return FineTuneJobStatus()


def _with_sync(ev: Evaluation, queue: QueueState) -> QueueState:
    """`queue`, stale when its Workload no longer asks for the pods the job's spec makes, and
    failed_to_start when its admission contradicts what the job's pods set themselves."""
    if queue.raw is None or queue.foreign or queue.left or ev.spec is None or ev.plan is None:
        return queue
    if not queue.finished:
        wanted = build_workload(ev.job.owner, ev.spec, ev.plan, queue.queue)
        queue = replace(queue, stale=pod_sets_differ(queue.raw, wanted))
    if queue.admitted and not queue.stale and not queue.failed_to_start:
        worker = build_worker_pod(ev.job.owner, ev.spec, ev.plan, 0)
        queue = replace(queue, failed_to_start=placement_conflict(worker, queue.placement))
    return queue


def deprecation_events(ev: Evaluation, old: FineTuneJobStatus) -> tuple[EventSpec, ...]:
    """A Warning the first time a job runs on with a deprecated spec form (the Planned
    condition's message keeps saying it afterwards: status.py)."""
    if not ev.deprecations:
        return ()
    text = describe_deprecations(ev.deprecations)
    planned = find(old.conditions, COND_PLANNED)
    if planned is not None and planned.message.startswith(text):
        return ()
    return (EventSpec("Warning", REASON_DEPRECATED_SPEC, text),)


def reconcile_job(
    job: JobRef,
    raw_spec: Mapping[str, Any],
    status: FineTuneJobStatus,
    pods: Sequence[PodView],
    now: datetime,
    *,
    planner: PlanFn,
    deleted_uids: Iterable[str] = (),
    ensured_generation: int | None = None,
    policy: JobPolicy | None = None,
    health: HealthInput | None = None,
    queue: QueueState | None = None,
    nodes: NodeReading | None = None,
) -> Outcome:
    """Everything one pass decides, with no I/O: the caller applies actions, then the status.

    `health` (what a scraping pass saw of the trainers) adds the straggler and hang decisions;
    None (a pass that did not scrape) leaves them as they were. `queue` (the job's Kueue
    Workload as read, reconcile/admission.py) gates its pods on Kueue's admission. `nodes`
    (the Nodes of its terminating pods, as read: reconcile/nodeloss.py) finds the pods lost
    with their node."""
    seen = mark_terminating(pods, deleted_uids)
    ev = evaluate_job(job, raw_spec, status, planner, policy)
    suspended = ev.spec is not None and ev.spec.suspend
    label = judge_queue_label(queue, status, seen, suspended=suspended, valid=ev.ok)
    if label is not None and label.outside_kueue:
        queue = None  # the label was added while it ran: it runs on as a job without it
    if queue is not None:
        # Also for an invalid spec: its Workload is deactivated, giving the quota back.
        ev = replace(ev, queue=_with_sync(ev, queue) if ev.ok else queue)
    own = health.own_rounds if health is not None else None
    new_status = compute_status(ev, status, seen, now, own, nodes)
    new_status = note_queue_label(new_status, label, now, job.generation)
    actions = decide_actions(
        ev, status, seen, now, ensured_generation=ensured_generation, own=own, nodes=nodes
    )
    extra: tuple[EventSpec, ...] = ()
    buffer, ratios = None, {}
    if health is not None:
        h = assess_health(ev, status, new_status, actions, seen, health, now)
        new_status, actions, extra, buffer, ratios = (
            h.status,
            h.actions,
            h.events,
            h.buffer,
            h.ratios,
        )
    events = (
        *condition_events(status.conditions, new_status.conditions),
        *deprecation_events(ev, status),
        *actions.events,
        *extra,
    )
    return Outcome(ev, new_status, actions, tuple(events), buffer, ratios)


def status_patch(old: Mapping[str, Any] | None, new: FineTuneJobStatus) -> dict[str, Any]:
    """A JSON merge patch of the top-level status fields that changed ({} when none did)."""
    before = read_status(old).to_json_dict()
    after = new.to_json_dict()
    patch: dict[str, Any] = {k: v for k, v in after.items() if before.get(k) != v}
    patch.update({k: None for k in before if k not in after})  # merge-patch removal
    return patch
