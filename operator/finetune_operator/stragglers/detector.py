"""`find_stragglers`: per-window robust ratios of each rank's compute time to its peers'.

Per epoch (see `epochs.py`) and per window of `window_steps` steps after the warm-up:
1. each rank's window statistic is the step-weighted *median* of its compute seconds, over
   records that are not checkpoint steps; a median ignores single spikes and heavy tails
   that a mean would follow;
2. its ratio is that median over the median of the *other* ranks' window medians: a global
   slowdown or drift moves both alike, and leaving the rank out keeps a two-rank job and two
   simultaneous stragglers measurable;
3. the window counts as slow when the ratio reaches `threshold` and the wait signal does not
   contradict it: a straggler is the rank the others wait for, so (when waits are recorded)
   the others' median wait must exceed the rank's own by at least `WAIT_CONFIRM_SHARE` of its
   excess compute. A rank that looks slow but that nobody waits for (a skewed timer, a busy
   host thread outside the critical path) is not holding the job back;
4. `consecutive_windows` slow windows in a row make a verdict, one per rank and epoch. A window
   where a rank's records cover less than `min_coverage` of the steps (dropped records) neither
   extends nor breaks its streak.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from statistics import median

from finetune_operator.stragglers.epochs import (
    Epoch,
    Incarnation,
    IncarnationKey,
    group_incarnations,
    incarnation_key,
    split_epochs,
)
from finetune_operator.stragglers.types import Detection, Policy, StepRecord, Verdict

# The others must wait at least this share of the rank's excess compute longer than it does.
# The ideal is 1 (every extra second of the straggler is a second the others wait); half
# leaves room for noise and for waits that land on the next step's sync point.
WAIT_CONFIRM_SHARE = 0.5


@dataclass
class _WindowStat:
    compute: float
    wait: float


@dataclass
class _EpochResult:
    verdicts: list[Verdict] = field(default_factory=list)
    ratios: dict[int, float] = field(default_factory=dict)
    streaks: dict[int, int] = field(default_factory=dict)
    windows: int = 0


def find_stragglers(records: Iterable[StepRecord], policy: Policy) -> Detection:
    """The stragglers in `records` (any order, duplicates and gaps allowed) under `policy`."""
    records = records if isinstance(records, list | tuple) else list(records)
    incarnations = group_incarnations(records)
    epochs = split_epochs(incarnations.values())
    if not epochs:
        return Detection(verdicts=(), ratios={}, streaks={})
    windows = _bucket(records, incarnations, epochs, policy)
    results = [_detect_epoch(e, w, policy) for e, w in zip(epochs, windows, strict=True)]
    earlier = tuple(v for r in results[:-1] for v in r.verdicts)
    current, last = results[-1], epochs[-1]
    return Detection(
        verdicts=tuple(current.verdicts),
        ratios=current.ratios,
        streaks=current.streaks,
        earlier=earlier,
        epoch_start_step=last.start,
        windows=current.windows,
        pods={rank: last.identity(rank) for rank in sorted(last.members)},
    )


def weighted_median(values: Sequence[float], weights: Sequence[int] | None = None) -> float:
    """The median, weighted by `weights` (the lower weighted median; None: all weigh 1)."""
    if weights is None:
        return median(values)
    pairs = sorted(zip(values, weights, strict=True))
    half, acc = sum(weights) / 2.0, 0
    for value, weight in pairs:
        acc += weight
        if acc >= half:
            return value
    return pairs[-1][0]


def loo_medians(values: Sequence[float]) -> list[float]:
    """For each i, the median of `values` without values[i]: one sort for all (a job has
    ranks x windows of these, so n medians of n-1 values each would dominate the run time)."""
    n = len(values)
    order = sorted(range(n), key=values.__getitem__)
    ranked = [values[j] for j in order]
    m = n - 1

    def at(pos: int, removed: int) -> float:  # the remaining list's element at `pos`
        return ranked[pos] if pos < removed else ranked[pos + 1]

    out = [0.0] * n
    for where, j in enumerate(order):
        if m % 2:
            out[j] = at(m // 2, where)
        else:
            out[j] = (at(m // 2 - 1, where) + at(m // 2, where)) / 2.0
    return out


@dataclass
class _Windows:
    """One epoch's complete windows: per rank and window, compute and wait samples."""

    origin: int  # first step after the warm-up
    complete: int
    compute: dict[int, list[list[float]]]
    wait: dict[int, list[list[float]]]
    weight: dict[int, list[list[int]]]
    weighted: bool = False  # some record averages several steps


def _bucket(
    records: Sequence[StepRecord],
    incarnations: dict[IncarnationKey, Incarnation],
    epochs: list[Epoch],
    policy: Policy,
) -> list[_Windows]:
    """Records into their epoch's complete windows, in one pass in arrival order (the order
    they sit in memory: a rank-major pass over 80,000 records is several times slower).
    Warm-up, checkpoint steps, duplicates and each epoch's last, incomplete window are left
    out. A record averaging several steps belongs to the window of its last step and weighs
    as many steps."""
    width = policy.window_steps
    out: list[_Windows] = []
    places: dict[IncarnationKey, list[tuple[_Windows, int, int, float]]] = {}
    for epoch in epochs:
        origin = epoch.start + policy.warmup_steps
        complete = max(0, (epoch.last_step - origin + 1) // width)
        win = _Windows(origin, complete, {}, {}, {})
        out.append(win)
        for rank, m in epoch.members.items():
            win.compute[rank] = [[] for _ in range(complete)]
            win.wait[rank] = [[] for _ in range(complete)]
            win.weight[rank] = [[] for _ in range(complete)]
            stop = math.inf if m.stop is None else m.stop
            places.setdefault(m.incarnation.key, []).append((win, rank, m.start, stop))
    for r in records:
        key = incarnation_key(r)
        step = r.step
        if r.checkpoint or incarnations[key].by_step[step] is not r:
            continue  # a checkpoint step, or a duplicate that a later copy replaced
        for win, rank, start, stop in places.get(key, ()):
            if not start <= step < stop or step - r.steps + 1 < win.origin:
                continue
            w = (step - win.origin) // width
            if w < win.complete:
                win.compute[rank][w].append(r.compute_seconds)
                win.wait[rank][w].append(r.wait_seconds)
                win.weight[rank][w].append(r.steps)
                if r.steps != 1:
                    win.weighted = True
    return out


def _window_stats(win: _Windows, w: int, policy: Policy) -> dict[int, _WindowStat]:
    needed = policy.min_coverage * policy.window_steps
    out: dict[int, _WindowStat] = {}
    for rank, cs in win.compute.items():
        samples = cs[w]
        weights = win.weight[rank][w] if win.weighted else None
        covered = len(samples) if weights is None else sum(weights)
        if not samples or covered < needed:
            continue
        out[rank] = _WindowStat(
            compute=weighted_median(samples, weights),
            wait=weighted_median(win.wait[rank][w], weights),
        )
    return out


def _judge(
    stats: dict[int, _WindowStat], policy: Policy
) -> dict[int, tuple[float, float | None, bool]]:
    """Per rank: (ratio, wait ratio, slow) against the other ranks in one window."""
    ranks = list(stats)
    base = loo_medians([stats[r].compute for r in ranks])
    waits_recorded = any(s.wait > 0 for s in stats.values())
    others_wait = loo_medians([stats[r].wait for r in ranks]) if waits_recorded else None
    out: dict[int, tuple[float, float | None, bool]] = {}
    for i, rank in enumerate(ranks):
        own = stats[rank]
        if base[i] <= 0:
            out[rank] = (1.0, None, False)
            continue
        ratio = own.compute / base[i]
        if others_wait is None:
            out[rank] = (ratio, None, ratio >= policy.threshold)
            continue
        wait_ratio = own.wait / others_wait[i] if others_wait[i] > 0 else None
        confirmed = others_wait[i] - own.wait >= WAIT_CONFIRM_SHARE * (own.compute - base[i])
        out[rank] = (ratio, wait_ratio, ratio >= policy.threshold and confirmed)
    return out


def _detect_epoch(epoch: Epoch, win: _Windows, policy: Policy) -> _EpochResult:
    res = _EpochResult(windows=win.complete, streaks=dict.fromkeys(epoch.members, 0))
    decided: set[int] = set()
    origin = win.origin
    for w in range(win.complete):
        stats = _window_stats(win, w, policy)
        if len(stats) < 2:
            continue  # nobody to compare with: streaks stand
        for rank, (ratio, wait_ratio, slow) in _judge(stats, policy).items():
            res.ratios[rank] = ratio
            res.streaks[rank] = res.streaks[rank] + 1 if slow else 0
            if slow and res.streaks[rank] >= policy.consecutive_windows and rank not in decided:
                decided.add(rank)
                pod, node = epoch.identity(rank)
                res.verdicts.append(
                    Verdict(
                        rank=rank,
                        pod=pod,
                        node=node,
                        ratio=ratio,
                        detected_at_step=origin + (w + 1) * policy.window_steps - 1,
                        window=w,
                        wait_ratio=wait_ratio,
                        epoch_start_step=epoch.start,
                    )
                )
    return res
