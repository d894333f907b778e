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
- Each failure of a pod's own (a rank of the pod raised or was killed; torch also restarts,
  and counts, a group whose peer left: finetune_trainer/launch.py reads the attempts' error
  files) is named by the rendezvous round it happened in: an id the round's ranks agree on
  when the group forms (finetune_trainer/startup_barrier.py), the same in every pod of the
  round; a group whose ranks died before that gets an id of its pod's alone. Each pod says
  the rounds its torchrun restarted after: live, on its trainers' metrics
  (`finetune_trainer_own_failure_round`, scraped each pass); in its crash report when its
  torchrun gives up (with the round that ended it); in its termination log when it is
  stopped (SIGTERM: preempted, evicted, drained) or finds the rendezvous closed.
- The restart ledger (`status.restartLedger`, `fold_ledger`) is the set of round ids already
  counted in `status.restarts`; each pass adds one restart per id not in it yet. So a
  failure every pod hits at once (every rank raising at the same step: a bad batch, an OOM
  everywhere, a code bug) is one restart, failures that alternate between pods (different
  rounds) are each counted, and the same round seen live and again at a pod's end is counted
  once. Every id added spends the budget and the job fails past maxRestarts, so the ledger
  holds at most maxRestarts + 1 ids (no pruning). An old status without a ledger keeps its
  number, and ids add to it. `status.restarts` is lowered in one case only: a round a pod lost
  with its node accounts for, counted before the loss was known, is taken back out of both
  (forgiveness.py).
- A pod's end is one more failure when it is its own (`counts_end`): its group failed of its
  own (a crash report other than a lost peer; a collective that timed out is its own), or it
  left no report (OOMKilled, killed from outside, an agent's error). It is counted, by its
  round (`end_round_of`: every pod that gave up in that round names it), when the pod is
  replaced (assess.py). A pod whose ranks only lost a peer, a preemption, a closed
  rendezvous: the end counts nothing, the restarts the pod made before still do.

A trainer image that reports only counts (no rounds) is read as that many rounds of its pod's
alone: counted once per pod, as before rounds were named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from finetune_operator.reconcile.crash import (
    carried_restarts,
    carried_rounds,
    end_round,
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


def own_rounds(pod: PodView, live: Mapping[str, frozenset[str]]) -> frozenset[str]:
    """The rounds of the failures of `pod`'s own that its torchrun restarted after, as far as
    anything says now: its trainers' last scrape (`live`, by pod uid), its crash report, or
    what its launcher carried out when it was stopped. A report with a count and no rounds
    (an older trainer image): that many rounds of the pod's alone."""
    message = pod.termination_message
    rounds = set(live.get(pod.uid, ()))
    carried = carried_rounds(message)
    if carried is not None:
        rounds.update(carried)
    else:
        rounds.update(f"{pod.uid}/{k}" for k in range(carried_restarts(message) or 0))
    return frozenset(rounds)


def end_round_of(pod: PodView) -> str:
    """The round of the failure that ended `pod` (its crash report names it); a pod that
    left none (killed from outside, an older image): one of its own, counted alone."""
    return end_round(pod.termination_message) or f"{pod.uid}/end"


def fold_ledger(
    ledger: Sequence[str],
    pods: Sequence[PodView],
    live: Mapping[str, frozenset[str]],
    forgiven: frozenset[str] = frozenset(),
) -> tuple[list[str], dict[str, list[str]]]:
    """The ledger after this pass (the round ids counted, oldest first), and the rounds it
    adds, by the name of the worker pod that reported each first: each adds one restart to
    `status.restarts` (a round several pods report is one). `forgiven`: rounds a pod was lost
    with its node in (nodeloss.py): its peers' failure in them is the node's, never counted."""
    counted = list(dict.fromkeys(ledger))
    seen = set(counted) | forgiven
    added: dict[str, list[str]] = {}
    for pod in sorted((p for p in pods if p.is_worker), key=lambda p: (p.name, p.uid)):
        for round_id in sorted(own_rounds(pod, live) - seen):
            seen.add(round_id)
            counted.append(round_id)
            added.setdefault(pod.name, []).append(round_id)
    return counted, added


def counts_end(pod: PodView) -> bool:
    """`pod`'s end (a counted disposition: disposition.py) is one more failure of its own,
    not the consequence of another's: a peer lost is counted only when a collective timed out
    (a hang: crash.is_collective_timeout, which nothing else would ever count)."""
    message = pod.termination_message
    return not is_peer_loss(message) or is_collective_timeout(message)
