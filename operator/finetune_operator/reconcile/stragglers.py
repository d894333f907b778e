"""What to do about stragglers (pure, `now` passed in): the status entries, the
`StragglerDetected` condition, Events and, with `action: evict`, the one pod to evict.

The detector (`finetune_operator.stragglers`) says which ranks are slow; this module adds the
operator's rules: confirmation over `consecutiveWindows` windows (carried across operator
restarts through `status.stragglers`), the cooldown, the hourly budget, and never dropping the
job below `minNodes` unless the replacement is coming.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from finetune_operator.api.constants import (
    REASON_NO_STRAGGLER,
    REASON_STRAGGLER_ALERTED,
    REASON_STRAGGLER_EVICTED,
    REASON_STRAGGLER_FOUND,
)
from finetune_operator.api.spec import StragglerSpec
from finetune_operator.api.status import Condition, Eviction, StragglerState
from finetune_operator.reconcile.conditions import EventSpec, Want
from finetune_operator.reconcile.observed import RUNNING, PodView, format_time, parse_time
from finetune_operator.stragglers import Detection

HOUR = timedelta(hours=1)
NO_STRAGGLER = Want("False", REASON_NO_STRAGGLER, "no straggler detected")


@dataclass(frozen=True)
class StragglerDecision:
    stragglers: tuple[StragglerState, ...] = ()  # for status.stragglers
    condition: Want = NO_STRAGGLER
    evict: PodView | None = None
    eviction: Eviction | None = None  # appended to status.evictions when `evict` is set
    events: tuple[EventSpec, ...] = ()
    carried: Mapping[int, StragglerState] = field(default_factory=dict)  # still carried


def carry_streaks(
    carried: Mapping[int, StragglerState], detection: Detection
) -> tuple[dict[int, int], dict[int, StragglerState]]:
    """The detector's streaks, extended by what status held when this operator started.

    A rank the detector has not judged yet keeps its carried streak; a slow window continues
    it (carried + the detector's own count); a normal window ends it. Returns the streaks and
    the entries still carried."""
    streaks = dict(detection.streaks)
    still: dict[int, StragglerState] = {}
    for rank, old in carried.items():
        now_pod = detection.pods.get(rank, (None, None))[0]
        if now_pod is not None and old.pod is not None and now_pod != old.pod:
            continue  # the rank is another pod's since a re-form: the streak was the old pod's
        mine = detection.streaks.get(rank, 0)
        if rank not in detection.ratios:
            streaks[rank], still[rank] = max(mine, old.streak), old
        elif mine > 0:
            streaks[rank], still[rank] = old.streak + mine, old
    return streaks, still


def _states(
    detection: Detection,
    streaks: Mapping[int, int],
    carried: Mapping[int, StragglerState],
    workers: Mapping[str, PodView],
    need: int,
) -> tuple[StragglerState, ...]:
    verdicts = {v.rank: v for v in detection.verdicts}
    out = []
    for rank, streak in sorted(streaks.items()):
        if streak <= 0:
            continue
        pod, node = detection.pods.get(rank, (None, None))
        old = carried.get(rank)
        if pod is None and old is not None:
            pod, node = old.pod, old.node
        if pod is not None and pod in workers:
            node = workers[pod].node or node
        verdict = verdicts.get(rank)
        ratio = detection.ratios.get(rank, verdict.ratio if verdict else old.ratio if old else 0.0)
        step = verdict.detected_at_step if verdict else old.step if old else 0
        out.append(
            StragglerState(
                rank=rank,
                pod=pod,
                node=node,
                ratio=round(ratio, 4),
                streak=streak,
                step=step,
                confirmed=streak >= need,
            )
        )
    return tuple(out)


def _why_not_evict(
    s: StragglerState,
    spec: StragglerSpec,
    evictions: Sequence[Eviction],
    workers: Mapping[str, PodView],
    min_nodes: int,
    desired: int,
    now: datetime,
    steps_left: int | None,
) -> str | None:
    """None when the rules allow evicting `s` now; otherwise why not (for the condition)."""
    pod = workers.get(s.pod or "")
    if pod is None or pod.terminating or pod.phase != RUNNING:
        return f"its pod {s.pod} is not a running worker"
    # An eviction costs a re-form (every rank's cold start, then the resume); within a window
    # of the end it cannot pay that back. Worse, a replacement created as the group finishes
    # joins a rendezvous whose members are in torchrun's exit barrier, which then waits out
    # its timeout (300 s) for the evicted agent before the job can succeed.
    if steps_left is not None and steps_left <= spec.window_steps:
        return f"training ends in {steps_left} steps (within one window of {spec.window_steps})"
    times = [t for e in evictions if (t := parse_time(e.time)) is not None]
    if times and now < max(times) + timedelta(seconds=spec.cooldown_seconds):
        until = format_time(max(times) + timedelta(seconds=spec.cooldown_seconds))
        return f"eviction cooldown until {until}"
    recent = sum(1 for t in times if t > now - HOUR)
    if recent >= spec.max_evictions_per_hour:
        return f"{recent} evictions in the last hour (maxEvictionsPerHour {spec.max_evictions_per_hour})"
    running = [p for p in workers.values() if p.phase == RUNNING and p.ready]
    # Below minNodes only while the replacement is coming: every slot is up, so the only gap
    # the eviction leaves is its own, which decide_actions refills as soon as the pod is gone.
    if len(running) - 1 < min_nodes and len(running) < desired:
        return f"only {len(running)} workers running and minNodes is {min_nodes}"
    return None


def _describe(s: StragglerState) -> str:
    where = f"pod {s.pod}" + (f" on node {s.node}" if s.node else "")
    return f"rank {s.rank} ({where}) computes {s.ratio:.2f}x the median"


def decide_stragglers(
    spec: StragglerSpec,
    detection: Detection,
    carried: Mapping[int, StragglerState],
    old: Sequence[StragglerState],
    old_condition: Condition | None,
    evictions: Sequence[Eviction],
    workers: Sequence[PodView],
    min_nodes: int,
    desired: int,
    now: datetime,
    *,
    steps_left: int | None = None,
) -> StragglerDecision:
    """One pass's straggler decision for an active job (`workers`: its live worker pods;
    `steps_left`: optimizer steps to the end of training, None where unknown)."""
    if not spec.enabled:
        return StragglerDecision()
    # Streaks of pods that went away were dropped with their records (samples.advance);
    # carry_streaks drops those whose rank another pod holds now.
    streaks, still = carry_streaks(carried, detection)
    return replace(
        _decide(spec, detection, streaks, still, old, old_condition, evictions, workers,
                min_nodes, desired, now, steps_left),
        carried=still,
    )  # fmt: skip


def _decide(
    spec: StragglerSpec,
    detection: Detection,
    streaks: Mapping[int, int],
    still: Mapping[int, StragglerState],
    old: Sequence[StragglerState],
    old_condition: Condition | None,
    evictions: Sequence[Eviction],
    workers: Sequence[PodView],
    min_nodes: int,
    desired: int,
    now: datetime,
    steps_left: int | None,
) -> StragglerDecision:
    by_name = {p.name: p for p in workers}
    states = _states(detection, streaks, still, by_name, spec.consecutive_windows)
    confirmed = [s for s in states if s.confirmed]
    was = {s.rank for s in old if s.confirmed}
    events = tuple(
        EventSpec("Warning", REASON_STRAGGLER_FOUND, f"straggler: {_describe(s)}")
        for s in confirmed
        if s.rank not in was
    )
    if not confirmed:
        # After an eviction the condition stays until the re-formed group has been judged.
        if (
            old_condition is not None
            and old_condition.reason == REASON_STRAGGLER_EVICTED
            and not detection.ratios
        ):
            return StragglerDecision(states, Want("True", REASON_STRAGGLER_EVICTED), events=events)
        return StragglerDecision(states, events=events)
    worst = max(confirmed, key=lambda s: s.ratio)
    if spec.action == "alert":
        msg = f"{_describe(worst)} (action: alert, not evicted)"
        return StragglerDecision(states, Want("True", REASON_STRAGGLER_ALERTED, msg), events=events)
    blocked = _why_not_evict(worst, spec, evictions, by_name, min_nodes, desired, now, steps_left)
    if blocked is not None:
        msg = f"{_describe(worst)}; not evicted: {blocked}"
        return StragglerDecision(states, Want("True", REASON_STRAGGLER_FOUND, msg), events=events)
    pod = by_name[worst.pod or ""]
    eviction = Eviction(
        pod=pod.name, node=pod.node, rank=worst.rank, ratio=worst.ratio, time=format_time(now)
    )
    msg = f"evicted {_describe(worst)}; its node is excluded for the replacement"
    event = EventSpec("Warning", REASON_STRAGGLER_EVICTED, msg)
    return StragglerDecision(
        states,
        Want("True", REASON_STRAGGLER_EVICTED, msg),
        evict=pod,
        eviction=eviction,
        events=(*events, event),
    )
