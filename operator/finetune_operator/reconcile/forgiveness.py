"""Which failed rounds a lost node accounts for, and so are never counted (pure).

A pod lost with its node (nodeloss.py) fails its peers: their collectives time out on the
silent peer and each survivor's torchrun restarts its group after a failure the launcher counts
as the pod's own (a hang and a vanished peer look the same from a rank). That failure is the
node's, a preemption-class event: it must not spend `faultTolerance.maxRestarts`.

What the operator knows, and when:
- the round each worker pod trains in, from its trainers' metrics (`finetune_trainer_round`),
  with when it last saw it (`seen_at`: the operator's memo; lost on its restart);
- the failed rounds each pod reports (live, or at its end), counted into the ledger the pass
  they are first seen (`counted_at`: memo too, lost on restart);
- a pod is lost only once its node has not been Ready for `nodeLostSeconds` and the pod was
  evicted (on a real cluster the node monitor grace, 40-50 s, plus 60 s by default).

So the survivors' report of the lost pod's round may come before the pod is judged lost (an
elastic job: they re-form alone after their collective timeout, a minute by default), in the
same pass, or after (a fixed-size job: its survivors wait for the replacement). Each lost pod
accounts for one round at most, the one it was in when its node went silent:

1. its last seen round `R`: forgiven ahead if no pod reported it yet (never counted), or taken
   back out of the count if it was counted *after* the operator last saw the pod training in it
   (the failure came after the pod was last known alive in `R`). A round counted before that
   is a genuine failure the pod re-formed after, its new round not scraped yet: not forgiven,
   and rule 2 looks for the right one;
2. a pod whose round is not known (never scraped in its round: it formed less than a scrape
   interval before the loss, or the operator restarted since): the first round counted at or
   after its node stopped being Ready that no other lost pod claims. Which round failed is not
   told by the survivors' live metrics (only the round's id), so this may take back a genuine
   failure of the window instead of the node's; the node's round then counts when reported:
   the count is the same, one failure per lost pod at most is ever given back.

A round counted before this operator started (no `counted_at`) is never taken back: nothing
says when it failed.

A pod is charged once: one found lost again in a later pass (its force delete failed, or is
not seen done yet, and the operator's memory of it went with a restart) is already in
`status.nodeLosses` for this outage of its node (same pod and node, recorded since the node
went down) and accounts for nothing more; rule 2 would otherwise take back the next round
counted in the window, a failure of the survivors' own.

A job whose budget the survivors' report spends before the pod is judged lost would fail in
that window, for good (Failed is terminal: its pods are deleted). So while a live worker pod
sits on a node whose Ready has not been True for less than `nodeLostSeconds` plus a slack
(`budget_hold`), the budget check holds the job instead: no pod replaced, nothing failed, the
WorkersReady condition says why. Then the pod is judged lost (its round taken back: the job
runs on) or the node is back or the hold runs out (the job fails as before: a user toleration
without seconds keeps the pod on its node, and nothing would ever end the wait). Which pods
were the failing round's peers is not known (the round's members are not exported): any live
worker on such a node holds the check, a bounded delay of a failure that was real.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from finetune_operator.api.status import FineTuneJobStatus, NodeLoss
from finetune_operator.reconcile.nodeloss import LostPod, NodeReading
from finetune_operator.reconcile.observed import PodView, parse_time

# Past nodeLostSeconds: the taint eviction controller's pass (seconds), the operator's next
# pass and its force delete; a pod not judged lost by then is not going to be soon.
HOLD_SLACK_SECONDS = 60.0


@dataclass(frozen=True)
class Forgiveness:
    """`ahead`: rounds never to count (no pod reported them yet); `taken_back`: rounds in the
    ledger to take out of `status.restarts`, by the name of the lost pod each is charged to."""

    ahead: frozenset[str] = frozenset()
    taken_back: Mapping[str, str] = field(default_factory=dict)

    @property
    def rounds(self) -> frozenset[str]:
        return self.ahead | frozenset(self.taken_back)


def _counted_after(round_id: str, counted_at: Mapping[str, datetime], since: datetime) -> bool:
    when = counted_at.get(round_id)
    return when is not None and when >= since


def _first_counted_since(
    counted: Sequence[str], claimed: Collection[str], counted_at: Mapping[str, datetime],
    since: datetime | None,
) -> str | None:  # fmt: skip
    """Rule 2: the oldest round counted once the node was down, not claimed yet. A node that
    is gone says no time it went down: none."""
    if since is None:
        return None
    fresh = (c for c in counted if c not in claimed and _counted_after(c, counted_at, since))
    return next(fresh, None)


def already_charged(x: LostPod, recorded: Sequence[NodeLoss]) -> bool:
    """`x` was judged lost in an earlier pass of this outage of its node: recorded in
    `status.nodeLosses` (`recorded`) with its name and node since the node went down. A node
    that is gone says no time: only a known round is forgiven then, never twice (claimed)."""
    since = x.node.since
    if since is None:
        return False
    for loss in recorded:
        when = parse_time(loss.time)
        if loss.pod == x.pod.name and loss.node == x.node.name and when and when >= since:
            return True
    return False


def forgive_lost_rounds(
    lost: Sequence[LostPod],
    ledger: Sequence[str],
    forgiven: Collection[str],
    counted_at: Mapping[str, datetime],
    recorded: Sequence[NodeLoss] = (),
) -> Forgiveness:
    """The rounds this pass's lost pods account for (the module docstring's rules): `ledger`,
    the rounds counted (this pass's additions included, with `counted_at` their pass's time);
    `forgiven`, the rounds already forgiven (`status.forgivenRounds`), never forgiven twice;
    `recorded`, `status.nodeLosses`: a pod in it for this outage was charged already."""
    counted = list(dict.fromkeys(ledger))
    claimed = set(forgiven)
    ahead: set[str] = set()
    back: dict[str, str] = {}
    for x in sorted(lost, key=lambda x: x.pod.name):
        if already_charged(x, recorded):
            continue
        r = x.round
        if r is not None and r in claimed:
            continue  # pods lost in the same round (two on one node): one failure, once
        if r is not None and r not in counted:
            ahead.add(r)
            claimed.add(r)
            continue
        if r is not None and x.seen_at is not None and _counted_after(r, counted_at, x.seen_at):
            back[r] = x.pod.name
            claimed.add(r)
            continue
        # Rule 2: which round is the node's is not known.
        first = _first_counted_since(counted, claimed, counted_at, x.node.since)
        if first is not None:
            back[first] = x.pod.name
            claimed.add(first)
    return Forgiveness(frozenset(ahead), back)


def taken_back(before: FineTuneJobStatus, after: FineTuneJobStatus) -> int:
    """How many restarts a pass took back: the rounds that left status.restartLedger for
    status.forgivenRounds (the operator's metrics count them apart from those it counted)."""
    moved = set(before.restart_ledger) - set(after.restart_ledger)
    return len(moved & set(after.forgiven_rounds))


def budget_hold(
    pods: Sequence[PodView], reading: NodeReading | None, now: datetime, node_lost_seconds: int
) -> str:
    """Why the budget check must wait (the module docstring), or "": a live worker pod on a
    node not Ready for less than `node_lost_seconds` plus the slack."""
    views = reading.views if reading is not None else {}
    for pod in sorted(pods, key=lambda p: p.name):
        node = views.get(pod.node or "")
        if not pod.is_worker or pod.terminating or node is None or node.since is None:
            continue
        down = (now - node.since).total_seconds()
        if node.ready != "True" and down < node_lost_seconds + HOLD_SLACK_SECONDS:
            return (
                f"restart budget spent, but pod {pod.name}'s node {node.name} has not been "
                f"Ready for {down:.0f} s: a lost node's failures are not counted, so the job "
                f"waits up to {node_lost_seconds + HOLD_SLACK_SECONDS:.0f} s for it to be judged "
                "lost (or back) before failing"
            )
    return ""
