"""One restart budget for the job, whichever layer restarts it (pure).

`faultTolerance.maxRestarts` bounds the job's *failure* restarts: torchrun's restarts of a
worker group inside its pod (the fast path for a transient fault: no rescheduling, no image
pull) and the operator's replacements of failed pods alike, so a trainer that fails the same
way every time is attempted at most maxRestarts + 1 times in all. Membership changes (a peer
joins, a preemption, a pod deleted or evicted, a straggler eviction, a scale change) are never
counted.

Two layers, one count (`status.restarts`):

- A worker pod is made with torchrun's `--max-restarts` set to the budget the job has left then
  (`in_pod_budget`), and annotated with the job's restarts then (`restart-attempt`). So its
  torchrun gives up no later than at the job's failure maxRestarts + 1, whether or not the
  operator ever sees its restarts: the total is bounded even if every scrape is missed.
- Each worker pod says how many of its torchrun's restarts followed a failure of its own (a
  rank of the pod raised or was killed; torch also restarts, and counts, a group whose peer
  left: finetune_trainer/launch.py reads the attempts' error files): live, on its trainers'
  metrics (`finetune_trainer_own_failure_restarts`, scraped each pass); in its crash report
  when its torchrun gives up; in its termination log when it is stopped (SIGTERM: preempted,
  evicted, drained) or finds the rendezvous closed. The count only grows over a pod's life.
- The restart ledger (`status.restartLedger`, `fold_ledger`) keeps, per pod (by uid), the
  count already added to `status.restarts`; each pass adds what a pod reports beyond it. So
  the same restart seen live and again at the pod's end is counted once, and failures that
  alternate between pods are each counted (the sum over pods, not the highest). Entries of
  pods that no longer exist are dropped once folded: their restarts stay in the total.
- A pod's end is one more failure when it is its own (`counts_end`): its group failed of its
  own (a crash report other than a lost peer; a collective that timed out is its own), or it
  left no report (OOMKilled, killed from outside, an agent's error). It is counted when the
  pod is replaced (assess.py). A pod whose ranks only lost a peer, a preemption, a closed
  rendezvous: the end counts nothing, the restarts the pod made before still do.

A failure that several pods hit of their own at once (every rank raising at the same step)
counts once per pod: nothing a pod reports tells one event seen by two pods from two events
(README "Not done yet"). A peer that only lost it counts nothing (PeerLost).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from finetune_operator.api.status import PodRestarts
from finetune_operator.reconcile.crash import (
    carried_restarts,
    has_crash_report,
    is_collective_timeout,
    is_peer_loss,
)
from finetune_operator.reconcile.observed import PodView

# An agent that ends on an exception (ChildFailedError once its restarts are spent, or any
# error of its own) exits 1 and shuts the job's rendezvous down for good on its way out
# (torch.distributed.launcher.api.launch_agent: only a signal leaves it open).
EXIT_AGENT_FAILED = 1


def closes_rendezvous(pod: PodView) -> bool:
    """`pod`'s torchrun shut the job's rendezvous down: no agent can join it again, so the
    store is replaced with the pod (reconcile/actions.py)."""
    return pod.exit_code == EXIT_AGENT_FAILED or has_crash_report(pod.termination_message)


def in_pod_budget(max_restarts: int, restarts: int) -> int:
    """torchrun's `--max-restarts` for a worker pod made when the job has used `restarts` of
    its `max_restarts`: what is left (0 once spent: one attempt, whose failure ends the job)."""
    return max(0, max_restarts - restarts)


def own_restarts(pod: PodView, live: Mapping[str, int]) -> int | None:
    """The restarts of `pod`'s torchrun that followed failures of the pod's own, as far as
    anything says now: its trainers' last scrape (`live`, by pod uid), its crash report, or
    what its launcher carried out when it was stopped. None: nothing says (no scrape yet, no
    report, an older trainer image)."""
    said = (live.get(pod.uid), carried_restarts(pod.termination_message))
    return max((v for v in said if v is not None), default=None)


def fold_ledger(
    ledger: Sequence[PodRestarts], pods: Sequence[PodView], live: Mapping[str, int]
) -> tuple[list[PodRestarts], int]:
    """The ledger after this pass, and how many restarts it adds to `status.restarts`: per
    worker pod, what it reports beyond its entry (never less: a count seen once stays
    counted). Only the pods in `pods` keep an entry: a pod gone has nothing more to report."""
    before = {e.uid: e for e in ledger}
    out: list[PodRestarts] = []
    added = 0
    for pod in sorted((p for p in pods if p.is_worker), key=lambda p: (p.name, p.uid)):
        entry = before.get(pod.uid)
        counted = entry.restarts if entry is not None else 0
        now = max(counted, own_restarts(pod, live) or 0)
        added += now - counted
        if entry is not None or now:
            out.append(PodRestarts(pod=pod.name, uid=pod.uid, restarts=now))
    return out, added


def counts_end(pod: PodView) -> bool:
    """`pod`'s end (a counted disposition: disposition.py) is one more failure of its own,
    not the consequence of another's: a peer lost is counted only when a collective timed out
    (a hang: crash.is_collective_timeout, which nothing else would ever count)."""
    message = pod.termination_message
    return not is_peer_loss(message) or is_collective_timeout(message)
