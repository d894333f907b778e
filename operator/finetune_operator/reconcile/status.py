"""compute_status: the FineTuneJob status the observed world implies (pure, `now` passed in)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from finetune_operator.api.constants import (
    COND_CHECKPOINT_FAILING,
    COND_FAILED,
    COND_HANG_DETECTED,
    COND_PLANNED,
    COND_STRAGGLER_DETECTED,
    COND_SUCCEEDED,
    COND_WORKERS_READY,
    PHASE_FAILED,
    PHASE_SUCCEEDED,
    REASON_ALL_WORKERS_READY,
    REASON_CHECKPOINT_SAVE_FAILED,
    REASON_CHECKPOINTS_COMMITTING,
    REASON_COMPLETED,
    REASON_NO_HANG,
    REASON_NO_STRAGGLER,
    REASON_PENDING,
    REASON_PLAN_FITS,
    REASON_RESTARTING,
    REASON_RUNNING,
    REASON_SUSPENDED,
    REASON_WORKERS_NOT_READY,
)
from finetune_operator.api.spec_compat import describe_deprecations
from finetune_operator.api.status import Condition, FineTuneJobStatus, NodeLoss
from finetune_operator.reconcile.assess import (
    Assessment,
    Mode,
    assess,
    queued_reason,
    root_cause_first,
)
from finetune_operator.reconcile.conditions import Want, derive_phase, find, set_condition
from finetune_operator.reconcile.crash import shorten
from finetune_operator.reconcile.evaluation import Evaluation
from finetune_operator.reconcile.nodeloss import NodeReading
from finetune_operator.reconcile.observed import PodView, format_time
from finetune_operator.reconcile.progress import TrainerProgress
from finetune_operator.resources.workload import workload_name

TERMINAL = (PHASE_FAILED, PHASE_SUCCEEDED)
MAX_PODS_DESCRIBED = 2
MAX_MESSAGE_CHARS = 1000  # condition messages: Kubernetes sets no limit, readers do
# status.nodeLosses: enough for the rounds to forgive to outlive their report (one re-form).
MAX_NODE_LOSSES_KEPT = 10
# Condition order in status: stable, so an unchanged status compares (and patches) as equal.
ORDER = (COND_PLANNED, COND_WORKERS_READY, COND_SUCCEEDED, COND_FAILED)


def _blocked_detail(a: Assessment) -> str:
    """Worker pods the kubelet cannot start (a missing Secret, an image that cannot be pulled),
    with its reason and message: what a user must fix, at `kubectl describe ftj`."""
    blocked = [p for p in a.workers.values() if p.blocked and p.phase == "Pending"]
    return "".join(f"; pod {p.name} cannot start: {p.blocked}" for p in blocked[:3])


def _progress(a: Assessment) -> Want:
    """Succeeded=Unknown while running: its reason says what the job is doing."""
    if a.waiting:
        # The root cause among the pods waiting out their backoff, not the first due: that
        # one may only have lost its peer (assess.root_cause_first).
        cause = root_cause_first([p for p, _ in a.waiting])[0]
        pod, due = next(w for w in a.waiting if w[0] is cause)
        msg = f"{pod.describe_failure()}; replacing it at {format_time(due)}"
        return Want("Unknown", REASON_RESTARTING, msg)
    if a.replace_now:
        # Each with its cause (reconcile/crash.py), the first few, root cause first: what
        # `kubectl describe` shows while the job restarts.
        first = root_cause_first(a.replace_now)[:MAX_PODS_DESCRIBED]
        causes = "; ".join(p.describe_failure() for p in first)
        more = len(a.replace_now) - MAX_PODS_DESCRIBED
        msg = f"{causes}{f'; and {more} more' if more > 0 else ''}; replacing them"
        if len(a.replace_now) == 1:
            msg = f"{causes}; replacing it"
        return Want("Unknown", REASON_RESTARTING, shorten(msg, MAX_MESSAGE_CHARS))
    if a.preempted_now or a.lost:
        names = ", ".join(
            [f"{p.name} ({v.why})" for p, v in a.preempted_now]
            + [f"{x.pod.name} (lost with node {x.node.name})" for x in a.lost]
        )
        return Want("Unknown", REASON_RESTARTING, f"replacing pods: {names}")
    if a.ready >= max(a.min_nodes, 1):
        return Want("Unknown", REASON_RUNNING, f"training on {a.ready} worker pods")
    detail = f"{a.ready}/{a.desired} worker pods ready{_blocked_detail(a)}"
    if a.restarts:
        return Want("Unknown", REASON_RESTARTING, detail)
    return Want("Unknown", REASON_PENDING, detail)


def _planned_message(ev: Evaluation) -> str:
    reason = ev.plan.reason if ev.plan else ""
    if not ev.deprecations:
        return reason
    # First, so that a long plan reason cannot cut off what the user must change.
    return shorten(f"{describe_deprecations(ev.deprecations)}; {reason}", MAX_MESSAGE_CHARS)


def _wants(ev: Evaluation, a: Assessment) -> dict[str, Want]:
    if a.mode is Mode.INVALID:
        reason, msg = ev.failure_reason or "", ev.failure_message
        return {
            COND_PLANNED: Want("False", reason, msg),
            COND_WORKERS_READY: Want("False", reason, "nothing was created"),
            COND_SUCCEEDED: Want("False", reason, msg),
            COND_FAILED: Want("True", reason, msg),
        }
    planned = Want("True", REASON_PLAN_FITS, _planned_message(ev))
    if a.mode is Mode.SUCCEEDED:
        done = Want("False", REASON_COMPLETED, a.message)
        return {
            COND_PLANNED: planned,
            COND_WORKERS_READY: done,
            COND_SUCCEEDED: Want("True", REASON_COMPLETED, a.message),
            COND_FAILED: done,
        }
    if a.mode is Mode.FAILED:
        failed = Want("False", a.failure_reason, a.message)
        return {
            COND_PLANNED: planned,
            COND_WORKERS_READY: failed,
            COND_SUCCEEDED: failed,
            COND_FAILED: Want("True", a.failure_reason, a.message),
        }
    if a.mode is Mode.SUSPENDED:
        held = Want("False", REASON_SUSPENDED, "spec.suspend is true: pods deleted")
        return {
            COND_PLANNED: planned,
            COND_WORKERS_READY: held,
            COND_SUCCEEDED: Want("Unknown", REASON_SUSPENDED, held.message),
            COND_FAILED: held,
        }
    if a.mode is Mode.QUEUED:
        assert ev.queue is not None
        reason = queued_reason(ev)
        waiting = Want("Unknown", reason, shorten(ev.queue.describe_wait(), MAX_MESSAGE_CHARS))
        return {
            COND_PLANNED: planned,
            COND_WORKERS_READY: Want("False", reason, waiting.message),
            COND_SUCCEEDED: waiting,
            COND_FAILED: Want("False", reason, waiting.message),
        }
    progress = _progress(a)
    ready_msg = f"{a.ready}/{a.desired} worker pods ready{_blocked_detail(a)}" + "".join(
        f"; {note}" for note in (a.hold, a.nodes_problem) if note
    )
    ready = (
        Want("True", REASON_ALL_WORKERS_READY, ready_msg)
        if a.desired and a.ready >= a.desired
        else Want("False", REASON_WORKERS_NOT_READY, ready_msg)
    )
    return {
        COND_PLANNED: planned,
        COND_WORKERS_READY: ready,
        COND_SUCCEEDED: progress,
        COND_FAILED: Want("False", progress.reason, progress.message),
    }


def _conditions(
    old: Sequence[Condition], wants: dict[str, Want], now: datetime, generation: int
) -> list[Condition]:
    conds = list(old)
    for ctype in ORDER:
        conds = set_condition(conds, ctype, wants[ctype], now, generation)
    # Set on the first visit (API conventions); reconcile/health.py owns them afterwards.
    for ctype, want in (
        (COND_STRAGGLER_DETECTED, Want("False", REASON_NO_STRAGGLER, "no straggler detected")),
        (COND_HANG_DETECTED, Want("False", REASON_NO_HANG, "training progresses")),
    ):
        if find(conds, ctype) is None:
            conds = set_condition(conds, ctype, want, now, generation)
    rank = {t: i for i, t in enumerate((*ORDER, COND_STRAGGLER_DETECTED, COND_HANG_DETECTED))}
    return sorted(conds, key=lambda c: rank.get(c.type, len(rank)))


def _node_losses(status: FineTuneJobStatus, a: Assessment, now: datetime) -> list[NodeLoss]:
    """status.nodeLosses with this pass's lost pods (the newest MAX_NODE_LOSSES_KEPT)."""
    new = [
        NodeLoss(
            pod=x.pod.name,
            node=x.node.name,
            time=format_time(now),
            down_seconds=None if x.down_seconds is None else int(x.down_seconds),
            round=x.round,
        )
        for x in a.lost
    ]
    return [*status.node_losses, *new][-MAX_NODE_LOSSES_KEPT:]


def _workload_of(ev: Evaluation, status: FineTuneJobStatus) -> str | None:
    """status.workload: the Workload's name while the job is queued in Kueue (also the pass
    that creates it) or leaving it, so that a pass after the label is removed still reads it;
    kept while it cannot be read; None once the job has none."""
    q = ev.queue
    if q is None or q.foreign:
        return None
    if q.unreadable:
        return status.workload
    return workload_name(ev.job.owner)


def compute_status(
    ev: Evaluation,
    status: FineTuneJobStatus,
    pods: Sequence[PodView],
    now: datetime,
    own: Mapping[str, frozenset[str]] | None = None,
    nodes: NodeReading | None = None,
) -> FineTuneJobStatus:
    """The new status; equal to `status` when nothing changed (so no patch is needed).
    `own`: what this pass scraped of each pod's failed rounds; `nodes`: the Nodes of the
    terminating pods as read this pass (assess.assess)."""
    a = assess(ev, status, pods, now, own, nodes)
    conds = _conditions(status.conditions, _wants(ev, a), now, ev.job.generation)
    update: dict[str, object] = {
        "conditions": conds,
        "phase": derive_phase(conds),
        "restarts": a.restarts,
        "restart_ledger": list(a.ledger),
        "forgiven_rounds": list(a.forgiven),
        "preemptions": a.preemptions,
        "ready_workers": a.ready,
        "observed_generation": ev.job.generation,
    }
    update["workload"] = _workload_of(ev, status)
    if a.lost:
        update["node_losses"] = _node_losses(status, a, now)
    if ev.plan is not None:
        update["plan"] = ev.plan
        if ev.plan.fits:
            update["world_size"] = ev.plan.world_size
            update["strategy"] = ev.plan.strategy
    if ev.spec is not None and ev.spec.training.max_steps is not None:
        update["total_steps"] = ev.spec.training.max_steps
    if a.mode is Mode.ACTIVE:
        update["completion_time"] = None  # a refused spec fixed by the user runs again
        if status.start_time is None:
            update["start_time"] = format_time(now)
    elif a.mode in (Mode.SUCCEEDED, Mode.FAILED, Mode.INVALID) and status.completion_time is None:
        update["completion_time"] = format_time(now)
    return status.model_copy(update=update)


def note_apply_errors(
    status: FineTuneJobStatus, errors: Sequence[str], now: datetime, generation: int
) -> FineTuneJobStatus:
    """Status that says why objects could not be applied (a quota, RBAC, a webhook).

    Events alone scroll away; the WorkersReady condition keeps the reason visible until the
    next pass succeeds (which rewrites it from the observed pods).
    """
    ready = find(status.conditions, COND_WORKERS_READY)
    if not errors or ready is None or ready.status == "True" or status.phase in TERMINAL:
        return status
    want = Want("False", REASON_WORKERS_NOT_READY, "could not apply: " + "; ".join(errors))
    conds = set_condition(status.conditions, COND_WORKERS_READY, want, now, generation)
    return status.model_copy(update={"conditions": conds})


def note_checkpoint_health(
    status: FineTuneJobStatus, progress: TrainerProgress, now: datetime, generation: int
) -> FineTuneJobStatus:
    """CheckpointFailing: True while the newest save the trainers report failed and no save
    has committed since (training goes on, but a restart would redo everything after the
    last commit); False once a later save commits. Call after `merge_progress`, so the last
    checkpoint is up to date. A pass where the trainers reported nothing keeps the condition.
    """
    failed = progress.checkpoint_failed_step
    committed = status.last_checkpoint.step if status.last_checkpoint else 0
    newest = f"step {committed}" if committed else "none"
    if failed is not None and failed > committed:
        n = progress.checkpoint_failures
        so_far = f", {n} failed saves so far" if n else ""
        want = Want(
            "True",
            REASON_CHECKPOINT_SAVE_FAILED,
            f"checkpoint save at step {failed} failed{so_far}; newest committed checkpoint: "
            f"{newest} (the trainer log has the traceback)",
        )
    elif (
        failed is None
        and progress.checkpoint_failures is None
        # A final report carries no failure count but does name the step it committed.
        and progress.checkpoint_step is None
        and (find(status.conditions, COND_CHECKPOINT_FAILING) is not None)
    ):
        return status
    else:
        want = Want(
            "False", REASON_CHECKPOINTS_COMMITTING, f"newest committed checkpoint: {newest}"
        )
    conds = set_condition(status.conditions, COND_CHECKPOINT_FAILING, want, now, generation)
    return status.model_copy(update={"conditions": conds})
