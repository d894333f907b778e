"""The job's health in the reconcile pass (pure): stragglers and hangs, decided from the
trainers' scraped metrics, joined to the status and actions `reconcile_job` computed.

An eviction deletes one worker pod; its slot is refilled by decide_actions once the pod is
gone, with anti-affinity to every excluded node, and it spends no `maxRestarts` budget (the pod
is terminating, never Failed, in every later assessment). A hang deletes every worker pod and
counts as one restart: the group restarts from the last committed checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from finetune_operator.api.constants import (
    COND_FAILED,
    COND_HANG_DETECTED,
    COND_STRAGGLER_DETECTED,
    REASON_BACKOFF_LIMIT_EXCEEDED,
    REASON_HANG_DETECTED,
    REASON_STRAGGLER_EVICTED,
)
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile.actions import Actions, PodDeletion
from finetune_operator.reconcile.assess import Mode, assess
from finetune_operator.reconcile.conditions import (
    EventSpec,
    Want,
    derive_phase,
    find,
    set_condition,
)
from finetune_operator.reconcile.evaluation import Evaluation
from finetune_operator.reconcile.hangs import decide_hang
from finetune_operator.reconcile.observed import PodView
from finetune_operator.reconcile.samples import RankSample, RecordBuffer, advance
from finetune_operator.reconcile.stragglers import decide_stragglers
from finetune_operator.stragglers import find_stragglers, policy_from_spec

# A hung group cannot save a checkpoint (its collectives never return), so waiting the workers'
# long grace period (meant for the final save) gains nothing: they restart from the last one.
HANG_GRACE_SECONDS = 5
KEEP_WINDOWS = 50  # detection windows of records kept per job


@dataclass(frozen=True)
class HealthInput:
    """What one scraping pass saw. `buffer` None: this operator has no memory of the job yet
    (just started): the straggler streaks in status seed it."""

    samples: tuple[RankSample, ...] = ()
    buffer: RecordBuffer | None = None
    # Each running worker pod's failed rounds its torchrun restarted after, by pod uid (all
    # its ranks' pages said): the restart ledger's live feed (reconcile/budget.py).
    own_rounds: Mapping[str, frozenset[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Health:
    status: FineTuneJobStatus
    actions: Actions
    events: tuple[EventSpec, ...] = ()
    buffer: RecordBuffer = field(default_factory=RecordBuffer)
    ratios: dict[int, float] = field(default_factory=dict)


def _keep_steps(ev: Evaluation) -> int:
    assert ev.spec is not None
    policy = policy_from_spec(ev.spec.fault_tolerance.stragglers)
    # The detector reads the buffer's first records as the start of the run (it skips a
    # warm-up there and aligns its windows from it), so the buffer keeps many windows: trimming
    # then rarely moves that start. Bounded all the same, whatever the run's length.
    windows = max(KEEP_WINDOWS, policy.consecutive_windows + 2)
    return policy.warmup_steps + windows * policy.window_steps


def assess_health(
    ev: Evaluation,
    before: FineTuneJobStatus,
    status: FineTuneJobStatus,
    actions: Actions,
    pods: Sequence[PodView],
    seen: HealthInput,
    now: datetime,
) -> Health:
    """Status and actions with the straggler and hang decisions added."""
    buffer = seen.buffer or RecordBuffer(carried={s.rank: s for s in before.stragglers})
    a = assess(ev, before, pods, now, seen.own_rounds)
    if a.mode is not Mode.ACTIVE or ev.spec is None:
        cleared = status.model_copy(update={"stragglers": [], "last_progress_time": None})
        return Health(cleared, actions, buffer=RecordBuffer())
    spec = ev.spec
    workers = list(a.workers.values())
    live = {p.name: p.node for p in workers}
    buffer = advance(buffer, seen.samples, live, _keep_steps(ev))
    detection = find_stragglers(buffer.records, policy_from_spec(spec.fault_tolerance.stragglers))
    step_now = max((s.step for s in seen.samples), default=None)
    total = spec.training.max_steps
    steps_left = total - step_now if total is not None and step_now is not None else None
    straggler = decide_stragglers(
        spec.fault_tolerance.stragglers,
        detection,
        buffer.carried,
        before.stragglers,
        find(before.conditions, COND_STRAGGLER_DETECTED),
        before.evictions,
        workers,
        a.min_nodes,
        a.desired,
        now,
        steps_left=steps_left,
    )
    buffer = replace(buffer, carried=straggler.carried)
    gen = ev.job.generation
    conds = set_condition(status.conditions, COND_STRAGGLER_DETECTED, straggler.condition, now, gen)
    update: dict[str, object] = {"stragglers": list(straggler.stragglers)}
    deletes: list[PodDeletion] = []
    events = list(straggler.events)
    if straggler.evict is not None and straggler.eviction is not None:
        deletes.append(
            PodDeletion(straggler.evict.name, straggler.evict.uid, REASON_STRAGGLER_EVICTED)
        )
        update["evictions"] = [*status.evictions, straggler.eviction]
        node = straggler.eviction.node
        if node and node not in status.excluded_nodes:
            update["excluded_nodes"] = [*status.excluded_nodes, node]
    judging = bool(workers) and a.ready >= a.desired and not a.terminating
    hang = decide_hang(
        spec.fault_tolerance.hang_timeout_seconds,
        seen.samples,
        before.step,
        step_now,
        before.last_progress_time,
        find(before.conditions, COND_HANG_DETECTED),
        judging=judging and straggler.evict is None,
        now=now,
    )
    conds = set_condition(conds, COND_HANG_DETECTED, hang.condition, now, gen)
    update["last_progress_time"] = hang.last_progress_time
    if hang.hung:
        budget = spec.fault_tolerance.max_restarts
        message = hang.condition.message or "hang detected"
        events.append(EventSpec("Warning", REASON_HANG_DETECTED, message))
        update["hangs"] = status.hangs + 1
        if status.restarts >= budget:
            failed = Want(
                "True",
                REASON_BACKOFF_LIMIT_EXCEEDED,
                f"{message}; all {budget} restarts allowed are used",
            )
            conds = set_condition(conds, COND_FAILED, failed, now, gen)
        else:
            update["restarts"] = status.restarts + 1
        deletes += [
            PodDeletion(p.name, p.uid, REASON_HANG_DETECTED, HANG_GRACE_SECONDS) for p in workers
        ]
        buffer = RecordBuffer()
    update["conditions"] = conds
    update["phase"] = derive_phase(conds)
    taken = {d.uid for d in actions.delete}
    more = tuple(d for d in deletes if d.uid not in taken)
    new_actions = replace(actions, delete=(*actions.delete, *more))
    return Health(
        status.model_copy(update=update),
        new_actions,
        tuple(events),
        buffer,
        dict(detection.ratios),
    )
