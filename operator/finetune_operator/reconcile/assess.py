"""One reading of the job's situation, shared by compute_status and decide_actions so the
status written and the actions taken always agree."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from finetune_operator.api.constants import (
    COND_FAILED,
    COND_SUCCEEDED,
    REASON_BACKOFF_LIMIT_EXCEEDED,
    REASON_EVICTED,
    REASON_QUEUE_LABEL_REMOVED,
    REASON_QUEUED,
    REASON_TRAINER_REFUSED,
)
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile.admission import FAILED_TO_START
from finetune_operator.reconcile.budget import counts_end, end_round_of, fold_ledger
from finetune_operator.reconcile.conditions import find, is_true
from finetune_operator.reconcile.crash import is_peer_loss, shorten
from finetune_operator.reconcile.disposition import Verdict, classify_exit
from finetune_operator.reconcile.evaluation import Evaluation
from finetune_operator.reconcile.forgiveness import budget_hold, forgive_lost_rounds
from finetune_operator.reconcile.nodeloss import (
    LostPod,
    NodeReading,
    lost_again,
    lost_pods,
    unreadable_detail,
)
from finetune_operator.reconcile.observed import FAILED, RUNNING, SUCCEEDED, PodView
from finetune_operator.reconcile.progress import parse_trainer_error
from finetune_operator.resources import node_range

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Mode(enum.Enum):
    INVALID = "invalid"  # spec refused or plan infeasible: nothing may exist
    ACTIVE = "active"  # pods should run
    SUSPENDED = "suspended"  # pods deleted, ConfigMap/Services/checkpoints kept
    QUEUED = "queued"  # Kueue has not admitted it (or evicted it): no pods, like SUSPENDED
    SUCCEEDED = "succeeded"  # terminal: training finished
    FAILED = "failed"  # terminal: replacement budget spent


@dataclass(frozen=True)
class Assessment:
    mode: Mode
    workers: dict[int, PodView] = field(default_factory=dict)  # live (not terminating) by slot
    rendezvous: PodView | None = None
    terminating: frozenset[str] = frozenset()  # pod names still going away
    replace_now: tuple[PodView, ...] = ()  # failed pods whose backoff has elapsed
    waiting: tuple[tuple[PodView, datetime], ...] = ()  # failed pods and when they are due
    # Failure restarts counted against maxRestarts, in the pods (torchrun) and of pods
    # (replace_now included): budget.py
    restarts: int = 0
    # The failed rendezvous rounds counted in `restarts` (budget.fold_ledger).
    ledger: tuple[str, ...] = ()
    # The rounds lost pods account for (forgiveness.py): never counted, or taken back.
    forgiven: tuple[str, ...] = ()
    # Pods that ended without being at fault (disposition.py): replaced at once, not counted.
    preempted_now: tuple[tuple[PodView, Verdict], ...] = ()
    preemptions: int = 0  # including preempted_now
    ready: int = 0
    desired: int = 0
    min_nodes: int = 0
    any_worker_succeeded: bool = False
    message: str | None = None  # for terminal transitions: what happened
    failure_reason: str = REASON_BACKOFF_LIMIT_EXCEEDED  # the Failed condition's, in FAILED
    # Kueue's admission cannot be read (admission.QueueState.unknown) while workers run: they
    # are kept, and no pod is created; why, for the job's condition.
    hold: str = ""
    # Terminating pods lost with their node (nodeloss.py): force-deleted, in any mode; in an
    # active job each is a preemption and its slot is filled in the same pass.
    lost: tuple[LostPod, ...] = ()
    # Pods lost and counted on an earlier pass, still listed: force-deleted again, uncounted.
    lost_again: tuple[PodView, ...] = ()
    # Why some terminating pods cannot be judged (their Nodes unreadable), for the condition.
    nodes_problem: str = ""

    @property
    def live_pods(self) -> list[PodView]:
        pods = list(self.workers.values())
        return [self.rendezvous, *pods] if self.rendezvous is not None else pods


def root_cause_first(pods: Sequence[PodView]) -> list[PodView]:
    """Failed pods, the likeliest root cause first: a pod whose ranks only lost their peer is a
    consequence of another's failure (finished at about the same moment, in either order), so
    it comes after every pod that failed of its own; then by finish time and name."""
    return sorted(
        pods, key=lambda p: (is_peer_loss(p.termination_message), p.finished_at or EPOCH, p.name)
    )


def _backoff_due(pod: PodView, base: float, k: int, now: datetime) -> datetime:
    # A pod with no finish time (evicted before starting, say) is due at once.
    finished = pod.finished_at or now
    return finished + timedelta(seconds=base * (2**k))


def _walk_failures(
    ev: Evaluation,
    failed: Sequence[PodView],
    now: datetime,
    restarts: int,
    ledger: list[str],
    forgiven: frozenset[str],
) -> tuple[list[PodView], list[tuple[PodView, datetime]], int, PodView | None]:
    """Count the failed pods' ends on the job's failures (budget.py: `restarts` has every
    pod's restarts of its own already) and schedule their replacements: oldest failure first,
    but a pod whose ranks only lost a peer before any that failed of its own: each
    replacement doubles the next one's backoff, so the root cause's pod is replaced last and
    stays observed (and named in the Restarting condition) for as long as any pod it took
    down still waits. The group is whole again no later than in finish order: the last one
    due waits the same doubled backoff. An end of a pod's own is counted when the pod is
    replaced (a pod that waits is not counted yet, and counted once: it is deleted then), by
    its round: pods that gave up in the same round count once (its id goes to `ledger`); a
    round in `forgiven` (a pod lost with its node in it) is never counted.
    Returns the pods to replace now, those waiting (and when they are due), the job's failure
    restarts, and the pod whose failure is beyond the budget (None while there is budget)."""
    assert ev.spec is not None
    ft = ev.spec.fault_tolerance
    doubling = restarts  # the backoff's exponent
    replace_now: list[PodView] = []
    waiting: list[tuple[PodView, datetime]] = []
    order = sorted(
        failed,
        key=lambda p: (not is_peer_loss(p.termination_message), p.finished_at or EPOCH, p.name),
    )
    for pod in order:
        round_id = end_round_of(pod)
        own = counts_end(pod) and round_id not in ledger and round_id not in forgiven
        if own and restarts + 1 > ft.max_restarts:
            # maxRestarts + 1 attempts have failed: the restarts made are all there were.
            return replace_now, waiting, restarts, pod
        due = _backoff_due(pod, ft.backoff_seconds, doubling, now)
        if waiting or now < due:
            waiting.append((pod, due))
        else:
            replace_now.append(pod)
            doubling += 1
            if own:
                restarts += 1
                ledger.append(round_id)
    return replace_now, waiting, restarts, None


def _sticky_mode(status: FineTuneJobStatus) -> tuple[Mode, str] | None:
    if is_true(status.conditions, COND_SUCCEEDED):
        return Mode.SUCCEEDED, ""
    failed = find(status.conditions, COND_FAILED)
    if (
        failed is not None
        and failed.status == "True"
        and failed.reason in (REASON_BACKOFF_LIMIT_EXCEEDED, REASON_TRAINER_REFUSED)
    ):
        return Mode.FAILED, failed.reason
    return None


def queued_reason(ev: Evaluation) -> str:
    """The reason of a job that runs no pod because of Kueue (its conditions, its pods'
    deletions): evicted, leaving Kueue (label removed), or waiting to be admitted."""
    q = ev.queue
    if q is not None and q.left:
        return REASON_QUEUE_LABEL_REMOVED
    return REASON_EVICTED if q is not None and q.evicted is not None else REASON_QUEUED


def _fold(
    status: FineTuneJobStatus,
    pods: Sequence[PodView],
    own: Mapping[str, frozenset[str]],
    lost: Sequence[LostPod],
    nodes: NodeReading | None,
    now: datetime,
) -> tuple[int, list[str], dict[str, list[str]], list[str]]:
    """This pass's count: the restarts, the ledger, the rounds it adds (by pod), and the
    rounds forgiven (status.forgivenRounds). The rounds a pod lost with its node accounts for
    are the node's (its peers' collectives timed out on it), never counted: those no pod
    reported yet are kept out of the ledger, those counted before the loss was known (an
    elastic job's survivors re-form and report theirs first) are taken back out of it."""
    before = frozenset((*status.forgiven_rounds, *(n.round for n in status.node_losses if n.round)))
    ahead = before | frozenset(x.round for x in lost if x.round)
    ledger, added = fold_ledger(status.restart_ledger, pods, own, ahead)
    restarts = status.restarts + sum(map(len, added.values()))
    counted_at = dict(nodes.counted_at) if nodes is not None else {}
    counted_at.update((r, now) for ids in added.values() for r in ids)
    forgiven = forgive_lost_rounds(lost, ledger, before, counted_at, status.node_losses)
    back = forgiven.taken_back
    ledger = [r for r in ledger if r not in back]
    rounds = list(dict.fromkeys((*status.forgiven_rounds, *sorted(forgiven.rounds))))
    return max(0, restarts - len(back)), ledger, added, rounds


def _exhausted_live(ev: Evaluation, added: Mapping[str, Sequence[str]], restarts: int) -> str:
    """Why the job failed when the failed rounds the pods report, while they still run, went
    beyond the budget: the pods that reported new ones this pass, most first."""
    assert ev.spec is not None
    used = ev.spec.fault_tolerance.max_restarts
    grew = sorted(added.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    pods = ", ".join(f"{name} ({len(ids)} new)" for name, ids in grew)
    return shorten(
        f"trainers failed of their own and were restarted by torchrun in their pods ({pods}): "
        f"{restarts} failures; all {used} restarts allowed are used ({used + 1} attempts "
        "failed); each pod's log has the tracebacks",
        1000,
    )


def assess(
    ev: Evaluation,
    status: FineTuneJobStatus,
    pods: Sequence[PodView],
    now: datetime,
    own: Mapping[str, frozenset[str]] | None = None,
    nodes: NodeReading | None = None,
) -> Assessment:
    """`own`: each running worker pod's failed rounds that its torchrun restarted after, by
    pod uid, as its trainers' metrics said on this pass's scrape (budget.py); None: not
    scraped. `nodes`: the Nodes of the terminating pods, as read this pass (nodeloss.py);
    None: not read (no pod is judged lost)."""
    lost: tuple[LostPod, ...] = ()
    if nodes is not None and ev.spec is not None:
        lost = lost_pods(pods, nodes, now, ev.spec.fault_tolerance.node_lost_seconds)
    restarts, ledger, added, forgiven_rounds = _fold(status, pods, own or {}, lost, nodes, now)
    forgiven = frozenset(forgiven_rounds)
    live = [p for p in pods if not p.terminating]
    workers = {p.index: p for p in live if p.is_worker and p.index is not None}
    seen = Assessment(
        Mode.ACTIVE,
        workers=workers,
        rendezvous=next((p for p in live if p.is_rendezvous), None),
        terminating=frozenset(p.name for p in pods if p.terminating),
        restarts=restarts,
        ledger=tuple(ledger),
        forgiven=tuple(forgiven_rounds),
        preemptions=status.preemptions,
        ready=sum(1 for p in workers.values() if p.ready and p.phase == RUNNING),
        any_worker_succeeded=any(p.phase == SUCCEEDED for p in workers.values()),
    )
    if not ev.ok:
        return replace(seen, mode=Mode.INVALID)
    assert ev.spec is not None and ev.plan is not None
    seen = replace(seen, desired=ev.plan.nodes, min_nodes=node_range(ev.spec, ev.plan)[0])
    if nodes is not None:
        again = lost_again(pods, nodes)
        seen = replace(
            seen, lost=lost, lost_again=again, nodes_problem=unreadable_detail(pods, nodes)
        )
    sticky = _sticky_mode(status)
    if sticky is not None:
        mode, reason = sticky
        # Over: nothing more is counted.
        return replace(
            seen,
            mode=mode,
            failure_reason=reason or seen.failure_reason,
            restarts=status.restarts,
            ledger=tuple(status.restart_ledger),
            forgiven=tuple(status.forgiven_rounds),
        )
    if ev.spec.suspend:
        return replace(seen, mode=Mode.SUSPENDED)
    if ev.queue is not None:
        # Kueue decides how many workers run, between minNodes and the planned nodes; an
        # eviction stops them like a suspend: nothing after this point is counted.
        # A stale Workload's admission is for other pods: they stop until it is replaced.
        q = ev.queue
        if (q.left and not q.unknown) or q.deleting:
            return replace(seen, mode=Mode.QUEUED)  # stopped, as on an eviction
        running = [i for i, p in workers.items() if p.active]
        if q.failed_to_start and not running:
            # Kueue applies an admission once, when it starts the job: refused, never started.
            msg = q.describe_failed_to_start()
            return replace(seen, mode=Mode.FAILED, failure_reason=FAILED_TO_START, message=msg)
        if q.failed_to_start:
            # Started under an admission that agreed (a flavor edited since): Kueue's job
            # keeps running too; no pod is added under the one that no longer does.
            seen = replace(seen, hold=q.describe_failed_to_start())
        if q.unknown and q.evicted is None and not q.stale and running:
            # Kueue uninstalled, the operator's access to it revoked, a flavor unreadable:
            # no word that the admission was withdrawn, so what runs keeps running.
            count = max(running) + 1
            seen = replace(seen, hold=q.describe_hold())
        elif not q.admitted or q.admitted_count is None or q.stale:
            return replace(seen, mode=Mode.QUEUED)
        else:
            count = q.admitted_count
        seen = replace(seen, desired=count, min_nodes=min(seen.min_nodes, count))
    # torchrun agents exit 0 only once the whole worker group finished, so one success with
    # nobody still running means the training is done, even if a straggling pod had failed.
    if seen.any_worker_succeeded and not any(p.active for p in workers.values()):
        msg = "training finished: worker pods exited 0"
        return replace(seen, mode=Mode.SUCCEEDED, message=msg)
    failed_pods = [p for p in live if p.phase == FAILED]
    # A trainer that refused its configuration would refuse again: fail now, spend nothing.
    refusal = next(
        (e for p in failed_pods if (e := parse_trainer_error(p.termination_message))), None
    )
    if refusal is not None:
        msg = f"the trainer refused the job: {refusal}"
        return replace(seen, mode=Mode.FAILED, failure_reason=REASON_TRAINER_REFUSED, message=msg)
    ended = [p for p in live if p.phase == FAILED or (p.is_rendezvous and p.phase == SUCCEEDED)]
    store = seen.rendezvous
    store_created = (store.created_at or EPOCH) if store is not None and store.active else None
    verdicts = [(p, classify_exit(p, store_created)) for p in ended]
    preempted = tuple((p, v) for p, v in verdicts if not v.disposition.counted)
    preemptions = status.preemptions + len(preempted) + len(seen.lost)
    seen = replace(seen, preempted_now=preempted, preemptions=preemptions)
    failed = [p for p, v in verdicts if v.disposition.counted]
    used = ev.spec.fault_tolerance.max_restarts
    replace_now, waiting, counted, exhausted = _walk_failures(
        ev, failed, now, restarts, ledger, forgiven
    )
    if exhausted is not None or restarts > used:
        held = budget_hold(live, nodes, now, ev.spec.fault_tolerance.node_lost_seconds)
        if held:
            # Maybe a lost node's doing, not yet known (forgiveness.py): nothing replaced or
            # failed until it is judged lost or the hold runs out.
            return replace(seen, restarts=restarts, ledger=tuple(ledger), hold=held)
        if not failed:
            # Restarts inside pods that still run (failures alternating between them).
            msg = _exhausted_live(ev, added, restarts)
            return replace(seen, mode=Mode.FAILED, restarts=max(used, status.restarts), message=msg)
        # Say the root cause: a pod whose ranks only lost their peer is a consequence of
        # another's failure (finished at the same moment, in any order).
        culprit = root_cause_first(failed)[0]
        spent = f"all {used} restarts allowed are used ({used + 1} attempts failed)"
        msg = shorten(f"{culprit.describe_failure()}; {spent}", 1000)
        return replace(seen, mode=Mode.FAILED, restarts=max(used, status.restarts), message=msg)
    return replace(
        seen,
        replace_now=tuple(replace_now),
        waiting=tuple(waiting),
        restarts=counted,
        ledger=tuple(ledger),
    )
