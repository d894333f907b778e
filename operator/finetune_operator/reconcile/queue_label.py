"""Whether the job's Kueue queue-name label is in effect (pure): the QueueLabelApplied
condition, and whether this pass runs the job as one without the label.

Kueue's webhooks refuse adding or changing the queue-name label of a job that is not
suspended (jobframework's validateUpdateForQueueName: immutable while unsuspended); a change
on a suspended job is accepted, and its job reconciler then creates the Workload and the job
waits for admission. The operator has no webhook for its CRD, so it makes the refused changes
harmless instead of stopping a running job the user did not ask to stop:

- added while the job runs (worker pods up, never queued: no Workload, status.workload
  unset): it runs on outside Kueue, until it next stops. Suspended, it is handed to Kueue
  as a suspended job is (its Workload created, inactive until resumed; then it waits for
  admission); finished, there is nothing left to queue (nor a Workload named in its
  status). Sticky through a pass without workers (a restart), read back from the condition
  itself.
- changed while Kueue's admission runs it: it runs on in the LocalQueue that admitted it;
  its Workload moves once it holds no quota (admission.QueueState.moved).
- Kueue unreadable (the chart's kueue.enabled off while Kueue runs, or its CRD not served):
  the job neither starts nor adds a pod, and workers it runs under an admission read before
  are kept (admission.QueueState.unknown); the condition says so, with a Warning Event, so
  that a job kept running, or waiting, is not taken for one Kueue is managing: nothing the
  operator owes Kueue (PodsReady, Finished, the quota given back) can be written meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from finetune_operator.api.constants import (
    COND_QUEUE_LABEL_APPLIED,
    PHASE_FAILED,
    PHASE_SUCCEEDED,
    REASON_ADDED_WHILE_RUNNING,
    REASON_CHANGED_WHILE_RUNNING,
    REASON_KUEUE_UNREADABLE,
    REASON_LABEL_APPLIED,
)
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile.admission import QueueState
from finetune_operator.reconcile.conditions import Want, find, set_condition
from finetune_operator.reconcile.observed import PodView
from finetune_operator.resources.workload import QUEUE_LABEL


@dataclass(frozen=True)
class LabelVerdict:
    """The QueueLabelApplied condition this pass (None: removed, the job has no label), and
    whether the job runs this pass as one without the label (added while it ran)."""

    want: Want | None
    outside_kueue: bool = False


def _added_while_running(queue: str) -> str:
    return (
        f"the {QUEUE_LABEL} label (LocalQueue {queue}) was added while the job ran: it runs on "
        f"outside Kueue, its pods not counted in {queue}'s quota (Kueue refuses this change on "
        "a running job). It is handed to Kueue when it next stops: with spec.suspend true its "
        f"Workload is created, and once resumed the job waits for {queue} to admit it"
    )


def judge_queue_label(
    queue: QueueState | None,
    status: FineTuneJobStatus,
    pods: Sequence[PodView],
    *,
    suspended: bool,
    valid: bool,
) -> LabelVerdict | None:
    """What the job's queue-name label does this pass (see the module's docstring). `queue`:
    its Kueue standing as read (None: no label); `status`: the status before this pass;
    `pods`: its pods, deletions this operator asked for marked terminating. None: the
    condition is left as it is (a finished or invalid job, or nothing to say)."""
    before = find(status.conditions, COND_QUEUE_LABEL_APPLIED)
    if queue is None or queue.left:
        return LabelVerdict(None) if before is not None else None
    deferred = (
        before is not None and before.status == "False" and before.reason == REASON_ADDED_WHILE_RUNNING
    )  # fmt: skip
    outside = status.workload is None and not queue.exists and not suspended
    if not valid or status.phase in (PHASE_SUCCEEDED, PHASE_FAILED):
        if before is not None and deferred and outside:
            # Ended (or refused) outside Kueue: still a job without the label, so that its
            # status names no Workload it never had.
            return LabelVerdict(Want(before.status, before.reason), outside_kueue=True)
        return None
    running = any(p.is_worker and p.active for p in pods)
    if outside and (running or deferred):
        want = Want("False", REASON_ADDED_WHILE_RUNNING, _added_while_running(queue.queue))
        return LabelVerdict(want, outside_kueue=True)
    if queue.unreadable:
        now = "running workers kept as admitted, no pod added" if running else "no pod starts"
        text = (
            f"the {QUEUE_LABEL} label names LocalQueue {queue.queue}, but Kueue cannot be read "
            f"({queue.unreadable}): {now}, and nothing written to its Workload, until it can"
        )
        return LabelVerdict(Want("False", REASON_KUEUE_UNREADABLE, text))
    held = str(((queue.raw or {}).get("spec") or {}).get("queueName") or "")
    if queue.moved and queue.quota_reserved and running:
        text = (
            f"the {QUEUE_LABEL} label now names LocalQueue {queue.queue}, but LocalQueue {held} "
            "admitted the job: it runs on there (Kueue refuses this change on a running job); "
            f"its Workload moves to {queue.queue} once it holds no quota (suspended or evicted)"
        )
        return LabelVerdict(Want("False", REASON_CHANGED_WHILE_RUNNING, text))
    if before is None:
        return None
    text = f"the job is queued in Kueue's LocalQueue {queue.queue}"
    return LabelVerdict(Want("True", REASON_LABEL_APPLIED, text))


def note_queue_label(
    status: FineTuneJobStatus, verdict: LabelVerdict | None, now: datetime, generation: int
) -> FineTuneJobStatus:
    """`status` with QueueLabelApplied set (or removed) as `verdict` says."""
    if verdict is None:
        return status
    if verdict.want is None:
        kept = [c for c in status.conditions if c.type != COND_QUEUE_LABEL_APPLIED]
        return status.model_copy(update={"conditions": kept})
    conds = set_condition(
        status.conditions, COND_QUEUE_LABEL_APPLIED, verdict.want, now, generation
    )
    return status.model_copy(update={"conditions": conds})
