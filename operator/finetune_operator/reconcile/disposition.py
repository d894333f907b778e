"""Why a pod ended, and whether it counts against the job's `maxRestarts` (pure).

A *failure* is the job's own fault (a crash, an OOM kill, a bad config) and spends the
budget. A *preemption* is the cluster taking the pod away (eviction, node drain or shutdown,
spot reclaim: a graceful SIGTERM the trainer honoured, saving a final checkpoint) and a
*lost rendezvous* is a worker that died because the job's store went away (its pod deleted
or preempted): both are replaced at once, without backoff, and counted in
`status.preemptions` instead. Pods someone deleted (`deletionTimestamp`) are never counted:
they are replaced when they are gone.

The evidence, strongest first:
1. the pod's `DisruptionTarget` condition / an eviction's `status.reason` (Kubernetes says);
2. the trainer's final report `stopReason: "Signal"` (it stopped because it was told to);
3. exit code 143 (128 + SIGTERM): the process died of SIGTERM;
4. a worker created before the current rendezvous pod (or ended while there is none): it
   was started against a store that is gone. Unless its torchrun gave up on a failed worker
   group of its own (its crash report, not a peer lost): that failure is the job's, counted,
   even though the store was replaced since (the operator replaces it because such an
   agent shuts the rendezvous down: reconcile/actions.py);
5. a worker that joined the current store and whose agent then found its rendezvous shut
   down (torch's RendezvousClosedError, in its log's tail, or `rendezvousClosed` in the report
   its launcher left with its restarts: launch.carry_restarts): another agent gave up, and that
   one's failure is counted; the store is replaced. Workers are never created while the store's pod
   is going away (actions.py), so one created after the current store joined that store.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from datetime import datetime

from finetune_operator.reconcile.crash import has_crash_report, is_peer_loss, rendezvous_closed
from finetune_operator.reconcile.observed import SUCCEEDED, PodView

EXIT_SIGTERM = 143
STOP_REASON_SIGNAL = "Signal"  # the trainer's final report (finetune_trainer.termination_log)


class Disposition(enum.Enum):
    FAILURE = "Failure"  # counted against maxRestarts
    PREEMPTED = "Preempted"  # not counted
    RENDEZVOUS_LOST = "RendezvousLost"  # not counted
    # Its agent found the current store's rendezvous shut down by another agent that gave up
    # (whose failure is counted there): not counted, and the store is replaced (actions.py).
    RENDEZVOUS_CLOSED = "RendezvousClosed"

    @property
    def counted(self) -> bool:
        return self is Disposition.FAILURE


@dataclass(frozen=True)
class Verdict:
    disposition: Disposition
    why: str


def _report_stop_reason(message: str | None) -> str | None:
    try:
        data = json.loads(message or "")
    except ValueError:
        return None
    reason = data.get("stopReason") if isinstance(data, dict) else None
    return reason if isinstance(reason, str) else None


def classify_exit(pod: PodView, rendezvous_created: datetime | None) -> Verdict:
    """Why `pod` (finished, not being deleted) ended. `rendezvous_created`: when the current
    live rendezvous pod was created, None when there is none (lost, or being replaced)."""
    if pod.disruption:
        return Verdict(Disposition.PREEMPTED, f"disrupted ({pod.disruption})")
    if pod.is_rendezvous and pod.phase == SUCCEEDED:
        return Verdict(Disposition.PREEMPTED, "the rendezvous store was stopped")
    if _report_stop_reason(pod.termination_message) == STOP_REASON_SIGNAL:
        return Verdict(Disposition.PREEMPTED, "stopped by a signal after a final checkpoint")
    if pod.exit_code == EXIT_SIGTERM:
        return Verdict(Disposition.PREEMPTED, "terminated by SIGTERM")
    message = pod.termination_message
    if pod.is_worker and has_crash_report(message) and not is_peer_loss(message):
        return Verdict(Disposition.FAILURE, "its worker group failed")
    if pod.is_worker:
        if rendezvous_created is None:
            return Verdict(Disposition.RENDEZVOUS_LOST, "the rendezvous store is gone")
        if pod.created_at is not None and pod.created_at < rendezvous_created:
            return Verdict(Disposition.RENDEZVOUS_LOST, "its rendezvous store was replaced")
        if rendezvous_closed(pod.termination_message):
            why = "the job's rendezvous was shut down by an agent that gave up"
            return Verdict(Disposition.RENDEZVOUS_CLOSED, why)
    return Verdict(Disposition.FAILURE, "failed")
