"""Split step records into epochs: the runs of one worker group between two re-forms.

A rank is compared with its peers only within one epoch, because after a re-form rank N may
run on another pod and node, and the steps since the last checkpoint run a second time.

An *incarnation* is one worker process's run: the records with the same (pod, restart count,
rank, process start). The process start (in traces; the live buffer is dropped at a re-form
instead) tells apart the runs of a re-form that only added nodes: torchelastic restarts every
worker then but keeps the restart count, and a survivor often keeps its rank. A new epoch begins where an incarnation claims a rank (or a pod) that another
incarnation already holds in the current epoch, in the order of their first steps: after a
failure the survivors come back with a higher torchelastic restart count and a replacement
pod comes in with its own name; both resume from the same checkpoint. An incarnation whose
rank nobody claimed in the new epoch (a survivor of a scale-up keeps its restart count, which
torchelastic does not bump on a membership change) carries its later records over into it.
An incarnation older than the one it collides with is the tail of a superseded run whose first
records scrolled out of a rolling buffer (`_stale`): it is dropped, not made the current epoch.

Without pod names (synthetic traces) an incarnation is (restart count, rank): a re-form must
then change the restart count, as it does after a failure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise

from finetune_operator.stragglers.types import StepRecord

IncarnationKey = tuple[str | None, int, int, float | None]  # (pod, restart, rank, started)


@dataclass
class Incarnation:
    pod: str | None
    restart: int
    rank: int
    started: float | None = None
    by_step: dict[int, StepRecord] = field(default_factory=dict)  # a duplicate step: last wins
    first: int = 0  # first step covered (a record averaging n steps covers n)
    last: int = 0

    @property
    def key(self) -> IncarnationKey:
        return (self.pod, self.restart, self.rank, self.started)


@dataclass
class Member:
    """An incarnation's part in an epoch: its records with `start <= step < stop`."""

    incarnation: Incarnation
    start: int
    stop: int | None = None


@dataclass
class Epoch:
    start: int  # first step of the epoch (the resume step + 1)
    members: dict[int, Member] = field(default_factory=dict)  # rank -> member
    native_pods: set[str] = field(default_factory=set)

    @property
    def last_step(self) -> int:
        return max(
            (m.incarnation.last if m.stop is None else min(m.incarnation.last, m.stop - 1))
            for m in self.members.values()
        )

    def identity(self, rank: int) -> tuple[str | None, str | None]:
        """The pod and node that held `rank` in this epoch (its latest record's)."""
        m = self.members[rank]
        stop = m.stop
        steps = [s for s in m.incarnation.by_step if s >= m.start and (stop is None or s < stop)]
        if not steps:
            return m.incarnation.pod, None
        latest = m.incarnation.by_step[max(steps)]
        return latest.pod, latest.node


def group_incarnations(records: Iterable[StepRecord]) -> dict[IncarnationKey, Incarnation]:
    """Records by incarnation (`incarnation_key`); a duplicate step: the last one wins."""
    incs: dict[IncarnationKey, Incarnation] = {}
    for r in records:
        key = incarnation_key(r)
        inc = incs.get(key)
        if inc is None:
            inc = incs[key] = Incarnation(
                pod=r.pod, restart=r.restart, rank=r.rank, started=r.started
            )
        inc.by_step[r.step] = r
    for inc in incs.values():
        inc.first = min(r.step - r.steps + 1 for r in inc.by_step.values())
        inc.last = max(inc.by_step)
    return incs


def incarnation_key(r: StepRecord) -> IncarnationKey:
    return (r.pod, r.restart, r.rank, r.started)


def _stale(inc: Incarnation, epoch: Epoch) -> bool:
    """`inc` is an older run, not a re-form: its first records scrolled out of a rolling
    buffer, so it sorts after the epoch that replaced it. Either its pod already runs a later
    incarnation in `epoch`, or it belongs to an older generation (lower restart count than the
    epoch's) and stopped while the incarnation it collides with went on."""
    if inc.pod is not None and any(
        m.incarnation.pod == inc.pod and m.incarnation.restart > inc.restart
        for m in epoch.members.values()
    ):
        return True
    generation = max(m.incarnation.restart for m in epoch.members.values())
    holders = [
        m.incarnation
        for r, m in epoch.members.items()
        if r == inc.rank or (inc.pod is not None and m.incarnation.pod == inc.pod)
    ]
    return inc.restart < generation and all(h.last > inc.last for h in holders)


def split_epochs(incarnations: Iterable[Incarnation]) -> list[Epoch]:
    """The epochs in order; the last one is the group as it runs now. Arrival order does not
    matter: incarnations are taken in the order of their first steps."""
    epochs: list[Epoch] = []
    order = sorted(
        incarnations, key=lambda i: (i.first, i.restart, i.rank, i.pod or "", i.started or 0.0)
    )
    for inc in order:
        cur = epochs[-1] if epochs else None
        claims = cur is not None and (
            inc.rank in cur.members or (inc.pod is not None and inc.pod in cur.native_pods)
        )
        if cur is not None and claims and _stale(inc, cur):
            continue
        if cur is None or claims:
            cur = Epoch(start=inc.first)
            epochs.append(cur)
        cur.members[inc.rank] = Member(inc, inc.first)
        if inc.pod is not None:
            cur.native_pods.add(inc.pod)
    _carry_over(epochs)
    return epochs


def _carry_over(epochs: list[Epoch]) -> None:
    """Survivors of a re-form that kept their (pod, restart, rank) continue into the next
    epoch from its start; a pod that runs a new incarnation there does not (its old one died)."""
    for prev, nxt in pairwise(epochs):
        for rank, m in prev.members.items():
            inc = m.incarnation
            if (
                rank in nxt.members
                or inc.pod is None
                or inc.pod in nxt.native_pods
                or inc.last < nxt.start
            ):
                continue
            m.stop = nxt.start
            nxt.members[rank] = Member(inc, nxt.start)
