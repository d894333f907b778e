"""One restart budget for the job, whichever layer restarts it (pure).

`faultTolerance.maxRestarts` bounds the job's *failure* restarts: torchrun's restarts of a
worker group inside its pod (the fast path for a transient fault: no rescheduling, no image
pull) and the operator's replacements of failed pods alike, so a trainer that fails the same
way every time is attempted at most maxRestarts + 1 times in all. Membership changes (a peer
joins, a preemption, a pod deleted or evicted, a straggler eviction, a scale change) are never
counted.

Two layers, one count (`status.restarts`):

- A worker pod is made with torchrun's `--max-restarts` set to the budget the job has left then
  (`in_pod_budget`), and annotated with the job's restarts then (`PodView.restarts_before`).
  So its torchrun gives up no later than at the job's failure maxRestarts + 1, whether or not
  the operator ever saw its restarts: the total is bounded even if every scrape is missed.
- A pod whose torchrun gave up says in its crash report how many of its restarts followed a
  failure of its own (`restarts`: finetune_trainer/launch.py reads the attempts' error files;
  torch also restarts, and counts, a group whose peer left). Its end is then the job's
  failure number `restarts_before + restarts + 1` (`failure_number`): its restarts inside the
  pod show in `status.restarts` and spend the budget, the peers that left do not.

One failure is seen by every pod: a rank that raises makes its peers' collectives fail, so
every agent restarts its group (or gives up) on the same event. Numbering each pod's failures
on the job's count, from the count when the pod was made, gives the same event the same number
in every pod: it is counted once (the highest number, not a sum over pods). A pod whose ranks
only lost a peer (crash kind `PeerLost`) has no failure of its own at its end: the failure is
the peer pod's (numbered there) or the peer was taken away (not counted); the restarts its
torchrun made after its own earlier failures still happened (`restarts_made`). torch counts a peer's
departure as a failed group too, so a pod may have spent its `--max-restarts` on preemptions
and give up with budget left: it is replaced, the departures spend nothing. A pod that left no crash report (its container
killed from outside: OOMKilled, a SIGKILL of the pod; an older trainer image) is one more
failure: the next number.
"""

from __future__ import annotations

from finetune_operator.reconcile.crash import (
    has_crash_report,
    is_collective_timeout,
    is_peer_loss,
    reported_restarts,
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


def restarts_made(pod: PodView) -> int | None:
    """The job's failure restarts that had happened once `pod`'s torchrun made its restarts
    after failures of the pod's own (its `restart-attempt` + its report's `restarts`), however
    the pod then ended: a pod whose last attempt only lost a peer still restarted after its
    own earlier failures. None: no report or no annotation."""
    in_pod = reported_restarts(pod.termination_message)
    if in_pod is None or pod.restarts_before is None:
        return None
    return pod.restarts_before + in_pod


def failure_number(pod: PodView, restarts: int) -> int | None:
    """Which of the job's failures `pod`'s end is, counting from 1; `restarts`: the job's
    failure restarts counted so far. None: a consequence of another pod's failure or of a
    membership change (its ranks only lost a peer), never counted; but a peer lost by a
    collective timing out is counted (a hang: crash.is_collective_timeout)."""
    message = pod.termination_message
    if is_peer_loss(message) and not is_collective_timeout(message):
        return None
    made = restarts_made(pod)
    if made is None:
        return restarts + 1
    # The same event seen by several pods gets the same number: max() in the caller.
    return made + 1


def restarts_after(restarts: int, number: int | None, *, replaced: bool) -> int:
    """The job's failure restarts once `number` is known: the restarts inside the pod before
    it gave up have happened (number - 1); its replacement is one more (number)."""
    if number is None:
        return restarts
    return max(restarts, number if replaced else number - 1)
