"""Seeded synthetic traces of a synchronous data-parallel job, for the detector's tests and for
`bench/stragglers.py`.

The model: at step s, rank r computes for `base(s) * speed(pod, s) * noise`; then every rank
waits at the step's sync point until the slowest one arrives, so its wait is the slowest
compute minus its own plus a little communication. A straggler is a *pod* (its node) that is
slower than the rest from `onset` on; after a re-form the pods take other ranks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from finetune_operator.stragglers import StepRecord

BASE_SECONDS = 0.5
COMM_SECONDS = 0.01


@dataclass(frozen=True)
class Slow:
    pod: str
    factor: float
    onset: int = 1  # first slow step


@dataclass(frozen=True)
class Scenario:
    """A trace recipe. `quiet` scenarios have no straggler: any verdict is a false positive."""

    name: str
    steps: int = 10_000
    ranks: int = 8
    seed: int = 0
    slow: tuple[Slow, ...] = ()
    noise: str = "jitter"  # jitter | heavy
    heterogeneity: tuple[float, ...] = ()  # per-pod steady speed factors (below threshold)
    global_slowdowns: bool = False  # all ranks slow together, and drift
    spikes: float = 0.0  # probability of a single-step spike per rank and step
    checkpoint_every: int = 0
    warmup_slow: bool = True  # the first steps after each (re)start are slow and uneven
    reform_at: tuple[int, ...] = ()  # steps where the group re-forms (resumes 50 steps back)
    messy: bool = False  # dropped, duplicated and shuffled records
    waits: bool = True  # record wait seconds (False: compute only)
    unwaited: str | None = None  # a pod whose compute reads 1.4x but nobody waits for it
    aggregate: int = 1  # steps per record (the operator's scrape-averaged records)

    @property
    def quiet(self) -> bool:
        return not self.slow


@dataclass
class Trace:
    records: list[StepRecord] = field(default_factory=list)


def _noise(kind: str, rng: random.Random) -> float:
    if kind == "heavy":
        # Log-normal body with a Pareto tail: one step in 20 takes 1.5x to ~20x.
        x = math.exp(rng.gauss(0.0, 0.12))
        if rng.random() < 0.05:
            x *= 1.0 + min(rng.paretovariate(1.5), 20.0) * 0.5
        return x
    return max(0.5, rng.gauss(1.0, 0.04))


def _base(s: int, sc: Scenario) -> float:
    if not sc.global_slowdowns:
        return BASE_SECONDS
    drift = 1.0 + 0.5 * math.sin(s / 700.0)  # slow drift: all ranks alike
    slowdown = 2.5 if (s // 1000) % 3 == 2 else 1.0  # every third thousand steps: all slow
    return BASE_SECONDS * drift * slowdown


def segments(sc: Scenario) -> list[tuple[int, int, int]]:
    """(restart, first step, last step) of each epoch; a re-form resumes 50 steps back."""
    out, first, restart = [], 1, 0
    for at in sorted(sc.reform_at):
        out.append((restart, first, at))
        first, restart = at - 49, restart + 1
    out.append((restart, first, sc.steps))
    return out


def generate(sc: Scenario) -> list[StepRecord]:
    rng = random.Random(sc.seed)
    pods = [f"worker-{i}" for i in range(sc.ranks)]
    slow = {s.pod: s for s in sc.slow}
    hetero = dict(zip(pods, sc.heterogeneity, strict=False))
    records: list[StepRecord] = []
    for restart, first, last in segments(sc):
        order = pods[:] if restart == 0 else rng.sample(pods, len(pods))  # rank -> pod
        for s in range(first, last + 1):
            computes = []
            for rank in range(sc.ranks):
                pod = order[rank]
                c = _base(s, sc) * hetero.get(pod, 1.0) * _noise(sc.noise, rng)
                if pod in slow and s >= slow[pod].onset:
                    c *= slow[pod].factor
                if sc.warmup_slow and s - first < 5:
                    c *= rng.uniform(1.0, 4.0)  # compilation, cache warm-up, uneven
                if sc.spikes and rng.random() < sc.spikes:
                    c *= rng.uniform(3.0, 10.0)
                if sc.checkpoint_every and s % sc.checkpoint_every == 0:
                    c *= 6.0 if rank == 0 else 2.0  # rank 0 writes the metadata
                computes.append(c)
            slowest = max(computes)
            for rank, c in enumerate(computes):
                pod = order[rank]
                wait = slowest - c + COMM_SECONDS * rng.uniform(0.5, 1.5)
                shown = c * 1.4 if pod == sc.unwaited else c  # off the critical path
                records.append(
                    StepRecord(
                        step=s,
                        rank=rank,
                        compute_seconds=shown,
                        wait_seconds=wait if sc.waits else 0.0,
                        pod=pod,
                        node=f"node-{pod.split('-')[1]}",
                        restart=restart,
                        checkpoint=bool(sc.checkpoint_every and s % sc.checkpoint_every == 0),
                    )
                )
    if sc.aggregate > 1:
        records = _aggregate(records, sc.aggregate)
    if sc.messy:
        records = _mess_up(records, rng)
    return records


def _aggregate(records: list[StepRecord], n: int) -> list[StepRecord]:
    """Average every `n` steps of each rank into one record, as the operator's scrapes do."""
    groups: dict[tuple[int, int, int], list[StepRecord]] = {}
    for r in records:
        groups.setdefault((r.restart, r.rank, (r.step - 1) // n), []).append(r)
    out = []
    for recs in groups.values():
        last = max(recs, key=lambda r: r.step)
        out.append(
            StepRecord(
                step=last.step,
                rank=last.rank,
                compute_seconds=sum(r.compute_seconds for r in recs) / len(recs),
                wait_seconds=sum(r.wait_seconds for r in recs) / len(recs),
                pod=last.pod,
                node=last.node,
                restart=last.restart,
                checkpoint=any(r.checkpoint for r in recs),
                steps=len(recs),
            )
        )
    return out


def _mess_up(records: list[StepRecord], rng: random.Random) -> list[StepRecord]:
    kept = [r for r in records if rng.random() >= 0.15]  # 15% dropped
    kept += [r for r in kept if rng.random() < 0.05]  # 5% delivered twice
    rng.shuffle(kept)
    return kept


def slow_pods_at(sc: Scenario) -> Callable[[str | None, int], bool]:
    """Ground truth: is `pod` slow at `step`?"""
    onset = {s.pod: s.onset for s in sc.slow}
    return lambda pod, step: pod in onset and step >= onset[pod]
