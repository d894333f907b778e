"""The detector's robustness properties, one table row each (issue 7 item 1)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import pytest

from finetune_operator.api.spec import StragglerSpec
from finetune_operator.stragglers import (
    Detection,
    Policy,
    StepRecord,
    find_stragglers,
    policy_from_spec,
)
from finetune_operator.stragglers.detector import loo_medians, weighted_median
from tests.stragglers.synthetic import Scenario, Slow, generate

POLICY = Policy()  # threshold 1.2, 20-step windows, 3 in a row, 10 warm-up steps
ORIGIN = 1 + POLICY.warmup_steps  # first counted step of a trace that starts at step 1

Compute = Callable[[int, int], float]  # (rank, step) -> compute seconds


def sync_job(
    steps: int,
    compute: Compute,
    *,
    ranks: int = 4,
    first: int = 1,
    restart: int = 0,
    pods: list[str] | None = None,
    checkpoint: Callable[[int], bool] = lambda s: False,
    waits: bool = True,
) -> list[StepRecord]:
    """A synchronous job: every rank waits for the slowest at each step."""
    pods = pods or [f"pod-{r}" for r in range(ranks)]
    out = []
    for s in range(first, first + steps):
        cs = [compute(r, s) for r in range(ranks)]
        for r, c in enumerate(cs):
            out.append(
                StepRecord(
                    step=s, rank=r, compute_seconds=c,
                    wait_seconds=(max(cs) - c + 0.01) if waits else 0.0,
                    pod=pods[r], node=f"node-of-{pods[r]}", restart=restart,
                    checkpoint=checkpoint(s),
                )
            )  # fmt: skip
    return out


def slow_rank(rank: int, factor: float, *, since: int = 1, until: int = 10**9) -> Compute:
    return lambda r, s: 1.0 * (factor if r == rank and since <= s < until else 1.0)


def window_end(w: int) -> int:
    """Last step of window `w` of a trace starting at step 1."""
    return ORIGIN + (w + 1) * POLICY.window_steps - 1


def detected(d: Detection) -> list[tuple[int, str | None, int]]:
    return [(v.rank, v.pod, v.detected_at_step) for v in d.verdicts]


# ---- quiet traces: nobody is a straggler -------------------------------------------------

QUIET: list[tuple[str, list[StepRecord]]] = [
    ("identical-ranks", sync_job(400, lambda r, s: 1.0)),
    ("single-spikes", sync_job(400, lambda r, s: 50.0 if (r * 97 + s) % 37 == 0 else 1.0)),
    ("spike-burst-shorter-than-k-windows",
     sync_job(400, lambda r, s: 3.0 if r == 1 and 100 <= s < 140 else 1.0)),
    ("warm-up-after-start", sync_job(200, lambda r, s: 5.0 if r == 2 and s <= 10 else 1.0)),
    ("global-slowdown", sync_job(400, lambda r, s: 4.0 if 100 <= s < 300 else 1.0)),
    ("drift", sync_job(400, lambda r, s: 1.0 + s / 50.0)),
    ("mild-heterogeneity", sync_job(400, lambda r, s: 1.0 + 0.05 * r)),
    ("checkpoint-steps-slow-on-rank-0",
     sync_job(400, lambda r, s: 5.0 if r == 0 and s % 2 == 0 else 1.0,
              checkpoint=lambda s: s % 2 == 0)),
    ("below-threshold", sync_job(400, slow_rank(1, 1.15))),
    ("unwaited: slow-looking rank that nobody waits for",
     [replace(x, compute_seconds=1.5, wait_seconds=0.01) if x.rank == 3 else
      replace(x, wait_seconds=0.01) for x in sync_job(400, lambda r, s: 1.0)]),
    ("one-rank-job", sync_job(400, lambda r, s: 1.0, ranks=1)),
    ("empty", []),
]  # fmt: skip


@pytest.mark.parametrize("records", [q[1] for q in QUIET], ids=[q[0] for q in QUIET])
def test_quiet_traces_have_no_straggler(records: list[StepRecord]) -> None:
    d = find_stragglers(records, POLICY)
    assert d.verdicts == () and d.earlier == ()
    assert all(v == 0 for v in d.streaks.values())


def test_checkpoint_steps_would_be_a_straggler_if_not_ignored() -> None:
    """The checkpoint row above fails without the flag: the filter is what saves it."""
    records = sync_job(400, lambda r, s: 5.0 if r == 0 and s % 2 == 0 else 1.0)
    assert [v.rank for v in find_stragglers(records, POLICY).verdicts] == [0]


# ---- stragglers: found, and when ---------------------------------------------------------

FOUND: list[tuple[str, list[StepRecord], list[tuple[int, str | None, int]]]] = [
    ("from-start", sync_job(200, slow_rank(2, 1.3)), [(2, "pod-2", window_end(2))]),
    ("onset-at-window-3", sync_job(300, slow_rank(1, 1.5, since=window_end(2) + 1)),
     [(1, "pod-1", window_end(5))]),
    ("two-ranks-job", sync_job(200, slow_rank(0, 1.3), ranks=2), [(0, "pod-0", window_end(2))]),
    ("two-stragglers", sync_job(200, lambda r, s: {1: 1.5, 3: 1.35}.get(r, 1.0), ranks=8),
     [(1, "pod-1", window_end(2)), (3, "pod-3", window_end(2))]),
    ("no-wait-recorded: compute alone decides",
     sync_job(200, slow_rank(2, 1.3), waits=False), [(2, "pod-2", window_end(2))]),
    ("exactly-threshold", sync_job(200, slow_rank(2, 1.2)), [(2, "pod-2", window_end(2))]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("records", "expected"), [(f[1], f[2]) for f in FOUND], ids=[f[0] for f in FOUND]
)
def test_stragglers_found_after_k_windows(
    records: list[StepRecord], expected: list[tuple[int, str | None, int]]
) -> None:
    d = find_stragglers(records, POLICY)
    assert detected(d) == expected
    for v in d.verdicts:
        assert v.ratio >= POLICY.threshold and v.node == f"node-of-{v.pod}"


def test_k_minus_one_slow_windows_is_not_enough() -> None:
    k = POLICY.consecutive_windows
    burst = sync_job(300, slow_rank(1, 2.0, since=ORIGIN, until=window_end(k - 2) + 1))
    assert find_stragglers(burst, POLICY).verdicts == ()
    longer = sync_job(300, slow_rank(1, 2.0, since=ORIGIN, until=window_end(k - 1) + 1))
    assert detected(find_stragglers(longer, POLICY)) == [(1, "pod-1", window_end(k - 1))]


def test_ratios_and_streaks_describe_the_latest_window() -> None:
    d = find_stragglers(sync_job(200, slow_rank(2, 1.5)), POLICY)
    assert d.ratios[2] == pytest.approx(1.5) and d.ratios[0] == pytest.approx(1.0)
    assert d.streaks == {0: 0, 1: 0, 2: d.windows, 3: 0} and d.windows == (200 - 10) // 20


def test_wait_ratio_reports_how_little_the_straggler_waits() -> None:
    (v,) = find_stragglers(sync_job(200, slow_rank(2, 1.5)), POLICY).verdicts
    assert v.wait_ratio is not None and v.wait_ratio < 0.1


# ---- messy delivery: the answer does not depend on it ------------------------------------


def test_out_of_order_and_duplicated_records_give_the_same_answer() -> None:
    records = sync_job(300, slow_rank(3, 1.3, since=100))
    messy = records + records[::7]
    random.Random(1).shuffle(messy)
    assert find_stragglers(messy, POLICY) == find_stragglers(records, POLICY)


def test_dropped_records_hold_the_streak_instead_of_breaking_it() -> None:
    records = sync_job(200, slow_rank(2, 1.4))
    # Rank 2 reports nothing in window 1: windows 0, 2, 3 are its three slow windows in a row.
    gap = [r for r in records if not (r.rank == 2 and window_end(0) < r.step <= window_end(1))]
    assert detected(find_stragglers(gap, POLICY)) == [(2, "pod-2", window_end(3))]


def test_sparse_drops_below_coverage_still_count() -> None:
    records = sync_job(200, slow_rank(2, 1.4))
    sparse = [r for r in records if r.step % 3 != 0]  # two thirds of every window left
    assert detected(find_stragglers(sparse, POLICY)) == [(2, "pod-2", window_end(2))]


def test_records_averaging_several_steps_are_weighted_by_steps() -> None:
    """The operator's scrapes: one record per rank per 5 steps, the mean over them."""
    per_step = sync_job(200, slow_rank(1, 1.4))
    averaged = [
        replace(r, steps=5)
        for r in per_step
        if r.step % 5 == 0  # compute is constant here, so the mean is the step's value
    ]
    assert detected(find_stragglers(averaged, POLICY)) == [(1, "pod-1", window_end(2))]


# ---- re-forms: epochs ---------------------------------------------------------------------


def reformed(slow_pod: str, factor: float = 1.4) -> list[StepRecord]:
    """Epoch 0: pods 0..3 on ranks 0..3, restart 0, steps 1..200. Re-form after a failure:
    survivors restart 1, pod-1 replaced by pod-9 (restart 0), ranks reshuffled, resume from
    step 150 (the steps 151..200 run again)."""
    before = ["pod-0", "pod-1", "pod-2", "pod-3"]
    after = ["pod-3", "pod-9", "pod-0", "pod-2"]

    def on(pods: list[str]) -> Compute:
        return lambda r, s: factor if pods[r] == slow_pod else 1.0

    first = sync_job(200, on(before), pods=before)
    second = sync_job(200, on(after), pods=after, first=151)
    return first + [replace(x, restart=0 if x.pod == "pod-9" else 1) for x in second]


def test_verdicts_name_the_pod_of_each_epoch() -> None:
    d = find_stragglers(reformed("pod-2"), POLICY)
    assert [(v.rank, v.pod) for v in d.earlier] == [(2, "pod-2")]
    assert [(v.rank, v.pod, v.epoch_start_step) for v in d.verdicts] == [(3, "pod-2", 151)]
    assert d.epoch_start_step == 151
    assert d.pods == {0: ("pod-3", "node-of-pod-3"), 1: ("pod-9", "node-of-pod-9"),
                      2: ("pod-0", "node-of-pod-0"), 3: ("pod-2", "node-of-pod-2")}  # fmt: skip
    assert d.verdicts[0].detected_at_step == 151 + POLICY.warmup_steps + 3 * 20 - 1


def test_a_reform_resets_streaks_and_warm_up() -> None:
    """Slow for 2 windows before the re-form and 1 after: never 3 in a row in one epoch."""
    before = sync_job(60, slow_rank(0, 2.0))  # windows 0, 1 (steps 11..50) then partial
    after = sync_job(40, slow_rank(0, 2.0), first=51, restart=1)  # warm-up, then 1 window
    d = find_stragglers(before + after, POLICY)
    assert d.verdicts == () and d.earlier == () and d.epoch_start_step == 51
    assert d.streaks[0] == 1


def test_a_rolling_buffer_with_an_older_incarnation_keeps_the_new_epoch_current() -> None:
    """The operator's buffer still holds the tail of a pod's previous incarnation (restart
    0, steps 181..200) after its first steps scrolled out; the group re-formed at 151."""
    records = [r for r in reformed("pod-2") if r.restart == 1 or r.pod == "pod-9"
               or r.step > 180]  # fmt: skip
    d = find_stragglers(records, POLICY)
    assert d.epoch_start_step == 151 and [(v.rank, v.pod) for v in d.verdicts] == [(3, "pod-2")]


def test_survivors_of_a_scale_up_carry_over_into_the_new_epoch() -> None:
    """torchelastic keeps the survivors' restart count on a membership change; the newcomer
    takes rank 2 at step 101 (the survivors saved at 100 and resume from it)."""
    pods_before = ["pod-0", "pod-1", "pod-2"]
    first = sync_job(100, slow_rank(1, 1.4), ranks=3, pods=pods_before)
    second = sync_job(100, slow_rank(1, 1.4), ranks=3, first=101,
                      pods=["pod-0", "pod-1", "pod-new"])  # fmt: skip
    d = find_stragglers(first + second, POLICY)
    assert d.epoch_start_step == 101 and set(d.pods) == {0, 1, 2}
    assert [(v.rank, v.pod) for v in d.earlier] == [(1, "pod-1")]
    assert [(v.rank, v.pod) for v in d.verdicts] == [(1, "pod-1")]


def test_a_reform_that_only_adds_a_node_is_a_new_epoch_by_process_start() -> None:
    """Two ranks run to step 90 and saved at 80; a third node joins. torchelastic restarts
    both survivors on the same pods, ranks and restart count and they resume from 80 with the
    newcomer on rank 2. Rank 1 is slow for two windows before the join and one after: as in
    any re-form the streak starts again (2 + 1 is no verdict), and the new epoch starts at 81.
    Only the trace's process start tells the survivors' two runs apart."""
    before = sync_job(90, slow_rank(1, 2.0, since=ORIGIN + 40), ranks=2)  # windows 2, 3 slow
    after = sync_job(40, slow_rank(1, 2.0), ranks=3, first=81)  # warm-up, 1 window, partial
    trace = [replace(x, started=100.0) for x in before] + [replace(x, started=200.0) for x in after]
    d = find_stragglers(trace, POLICY)
    assert d.epoch_start_step == 81 and d.verdicts == () and d.streaks[1] == 1
    assert set(d.pods) == {0, 1, 2}
    # Without process starts the survivors' re-run steps 81..90 overwrite the first run's and
    # the streak runs on across the join: the reason the trainer writes `started`.
    blind = find_stragglers(before + after, POLICY)
    assert blind.epoch_start_step == 1 and [v.rank for v in blind.verdicts] == [1]


# ---- synthetic traces (reduced versions of bench/stragglers.py) --------------------------

QUIET_SYNTHETIC = [
    Scenario("heavy-tailed", steps=3000, noise="heavy"),
    Scenario("everything", steps=3000, noise="heavy", global_slowdowns=True, spikes=0.01,
             heterogeneity=(0.93, 1.0, 1.05, 1.1, 0.97, 1.08, 1.0, 0.95),
             checkpoint_every=200, reform_at=(1500,), messy=True),
    Scenario("scrape-averaged", steps=3000, aggregate=7, noise="heavy"),
]  # fmt: skip


@pytest.mark.parametrize("sc", QUIET_SYNTHETIC, ids=lambda s: s.name)
def test_synthetic_quiet_traces(sc: Scenario) -> None:
    assert find_stragglers(generate(sc), POLICY).all_verdicts == ()


ONSET = 521  # mid-window: windows start at 11 + 20k
CLAIMS = [  # bench/stragglers.py's claims on shorter traces: (scenario, latency bound)
    (Scenario("1.3x", steps=1200, slow=(Slow("worker-3", 1.3, ONSET),)), 4),
    (Scenario("1.3x-heavy", steps=1200, noise="heavy", slow=(Slow("worker-3", 1.3, ONSET),)), 10),
    (Scenario("1.5x-and-1.35x", steps=1200,
              slow=(Slow("worker-3", 1.5, ONSET), Slow("worker-6", 1.35, ONSET))), 4),
]  # fmt: skip


@pytest.mark.parametrize(("sc", "bound"), CLAIMS, ids=[c[0].name for c in CLAIMS])
def test_synthetic_stragglers_found_in_time_and_nobody_else(sc: Scenario, bound: int) -> None:
    d = find_stragglers(generate(sc), POLICY)
    assert sorted(v.pod for v in d.all_verdicts) == sorted(s.pod for s in sc.slow)
    for v in d.verdicts:
        assert (v.detected_at_step - ONSET + 1) / POLICY.window_steps <= bound


# ---- the pieces ---------------------------------------------------------------------------


def test_leave_one_out_medians_match_the_definition() -> None:
    rng = random.Random(0)
    for n in range(2, 10):
        values = [rng.random() for _ in range(n)]
        expect = [sorted(values[:i] + values[i + 1 :]) for i in range(n)]
        got = loo_medians(values)
        for e, g in zip(expect, got, strict=True):
            m = len(e)
            assert g == pytest.approx(e[m // 2] if m % 2 else (e[m // 2 - 1] + e[m // 2]) / 2)


@pytest.mark.parametrize(
    ("values", "weights", "expected"),
    [([1.0, 2.0, 9.0], None, 2.0), ([1.0, 2.0, 9.0], [1, 1, 5], 9.0), ([3.0, 1.0], [4, 1], 3.0)],
    ids=["unweighted", "heavy-last", "heavy-first"],
)
def test_weighted_median(values: list[float], weights: list[int] | None, expected: float) -> None:
    assert weighted_median(values, weights) == expected


def test_policy_from_spec_maps_the_detector_fields() -> None:
    spec = StragglerSpec.model_validate(
        {"threshold": 1.5, "windowSteps": 7, "consecutiveWindows": 4, "action": "alert"}
    )
    assert policy_from_spec(spec) == Policy(threshold=1.5, window_steps=7, consecutive_windows=4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"threshold": 1.0}, "threshold"), ({"window_steps": 0}, "windowSteps"),
     ({"consecutive_windows": 0}, "consecutiveWindows"), ({"min_coverage": 0.0}, "min_coverage")],
    ids=["threshold", "window", "consecutive", "coverage"],
)  # fmt: skip
def test_policy_refuses_nonsense_naming_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Policy(**kwargs)  # type: ignore[arg-type]


def test_all_pods_recreated_start_a_new_epoch() -> None:
    """A hang restart: every worker pod is new (restart count 0 again), resuming at 151."""
    old = sync_job(200, lambda r, s: 1.0)
    new = sync_job(200, slow_rank(1, 1.4), first=151, pods=[f"new-{r}" for r in range(4)])
    d = find_stragglers(old + new, POLICY)
    assert d.epoch_start_step == 151 and [(v.rank, v.pod) for v in d.verdicts] == [(1, "new-1")]
