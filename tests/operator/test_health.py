"""Stragglers and hangs in the reconcile pass: records from scrapes, the eviction rules, the
condition, hang detection — pure functions fed with what scrapes of real trainer pages give."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest

from finetune_operator.api.constants import COND_HANG_DETECTED, COND_STRAGGLER_DETECTED
from finetune_operator.api.spec import StragglerSpec
from finetune_operator.api.status import Eviction, FineTuneJobStatus, StragglerState
from finetune_operator.reconcile import HealthInput, Outcome, PodView, RecordBuffer, reconcile_job
from finetune_operator.reconcile.hangs import decide_hang
from finetune_operator.reconcile.observed import format_time
from finetune_operator.reconcile.samples import (
    RankSample,
    advance,
    parse_rank_samples,
    record_between,
)
from finetune_operator.reconcile.stragglers import carry_streaks, decide_stragglers
from finetune_operator.stragglers import Detection
from tests.operator.factories import make_plan, quickstart_raw
from tests.operator.test_reconcile import JOB, T0, cond, pod

PAGE = """\
# TYPE finetune_trainer_step gauge
finetune_trainer_step{finetunejob="qs",rank="1"} 12.0
# TYPE finetune_trainer_reforms gauge
finetune_trainer_reforms{finetunejob="qs",rank="1"} 2.0
# TYPE finetune_trainer_last_checkpoint_step gauge
finetune_trainer_last_checkpoint_step{finetunejob="qs",rank="1"} 10.0
# TYPE finetune_trainer_heartbeat_timestamp_seconds gauge
finetune_trainer_heartbeat_timestamp_seconds{finetunejob="qs",rank="1"} 1.7e9
# TYPE finetune_trainer_compute_duration_seconds histogram
finetune_trainer_compute_duration_seconds_bucket{finetunejob="qs",rank="1",le="+Inf"} 12.0
finetune_trainer_compute_duration_seconds_count{finetunejob="qs",rank="1"} 12.0
finetune_trainer_compute_duration_seconds_sum{finetunejob="qs",rank="1"} 3.6
# TYPE finetune_trainer_wait_duration_seconds histogram
finetune_trainer_wait_duration_seconds_bucket{finetunejob="qs",rank="1",le="+Inf"} 12.0
finetune_trainer_wait_duration_seconds_count{finetunejob="qs",rank="1"} 12.0
finetune_trainer_wait_duration_seconds_sum{finetunejob="qs",rank="1"} 1.2
"""


def test_parse_rank_samples_reads_a_trainer_page() -> None:
    (s,) = parse_rank_samples(PAGE, "qs-worker-1", "node-b")
    assert (s.rank, s.pod, s.node, s.step, s.restarts, s.checkpoint_step) == (
        1, "qs-worker-1", "node-b", 12, 2, 10,
    )  # fmt: skip
    assert (s.compute_sum, s.compute_count, s.wait_sum, s.heartbeat) == (3.6, 12.0, 1.2, 1.7e9)
    assert parse_rank_samples("not a page {", "p", None) == []
    assert parse_rank_samples('finetune_trainer_step{rank="0"} 3\n', "p", None) == []


def sample(rank: int, steps: int, compute: float, **kw: Any) -> RankSample:
    base: dict[str, Any] = {"pod": f"qs-worker-{rank}", "node": f"node-{rank}", "step": steps}
    base.update(kw)
    return RankSample(
        rank=rank,
        compute_sum=compute * steps,
        compute_count=steps,
        wait_sum=0.01 * steps,
        wait_count=steps,
        **base,
    )


@pytest.mark.parametrize(
    ("after", "expected"),
    [
        (sample(0, 15, 0.2), (15, 0.2, 5, False)),
        (sample(0, 15, 0.2, checkpoint_step=15), (15, 0.2, 5, True)),
        (sample(0, 10, 0.2), None),  # nothing new
        (sample(0, 3, 0.2), None),  # counter went down: a new process
        (sample(0, 15, 0.2, restarts=1), None),  # the group re-formed
        (sample(0, 15, 0.2, pod="qs-worker-9"), None),  # another pod
    ],
    ids=["delta", "checkpoint", "idle", "counter-reset", "re-form", "moved"],
)
def test_record_between(after: RankSample, expected: tuple[int, float, int, bool] | None) -> None:
    record = record_between(sample(0, 10, 0.2), after)
    if expected is None:
        assert record is None
        return
    assert record is not None
    got = (record.step, round(record.compute_seconds, 6), record.steps, record.checkpoint)
    assert got == expected
    assert record.pod == "qs-worker-0" and record.node == "node-0"


def test_buffer_restarts_on_re_form_and_on_a_pod_gone_and_stays_bounded() -> None:
    live = {"qs-worker-0": "node-0", "qs-worker-1": "node-1"}
    buf = RecordBuffer()
    for n in range(1, 40):
        buf = advance(buf, [sample(0, 5 * n, 0.2), sample(1, 5 * n, 0.2)], live, keep_steps=30)
    assert buf.records and max(r.step for r in buf.records) == 195
    assert min(r.step for r in buf.records) > 195 - 30
    # A scrape that timed out for rank 1 keeps its last sample.
    buf = advance(buf, [sample(0, 200, 0.2)], live, keep_steps=30)
    assert buf.last[1].step == 195
    # Rank 1 re-formed (torchelastic restart count moved): every rank's records restart, and
    # rank 0's old process (still finishing a step of the old group) makes no more records.
    reformed = advance(buf, [sample(0, 205, 0.2), sample(1, 3, 0.2, restarts=1)], live, 30)
    assert reformed.records == () and set(reformed.last) == {1}
    again = advance(reformed, [sample(0, 210, 0.2), sample(1, 8, 0.2, restarts=1)], live, 30)
    assert {r.rank for r in again.records} == {1} and set(again.last) == {1}
    # A pod that went away, or was replaced by a pod of its name on another node: the group
    # re-forms without it, so the survivors' records restart too.
    moved = {"qs-worker-0": "node-0", "qs-worker-1": "node-9"}
    for scraped, pods in (([], {"qs-worker-0": "node-0"}), ([sample(0, 205, 0.2)], moved)):
        gone = advance(buf, scraped, pods, 30)
        assert gone.records == () and gone.last == {}
        assert sample(0, 205, 0.2).process in gone.retired


def detection(ratios: dict[int, float], streaks: dict[int, int]) -> Detection:
    return Detection(
        verdicts=(),
        ratios=ratios,
        streaks=streaks,
        pods={r: (f"qs-worker-{r}", f"node-{r}") for r in ratios},
    )


def state(rank: int, streak: int, **kw: Any) -> StragglerState:
    return StragglerState(
        rank=rank, pod=f"qs-worker-{rank}", node=f"node-{rank}", ratio=1.5, streak=streak, **kw
    )


@pytest.mark.parametrize(
    ("carried", "ratios", "streaks", "want", "still"),
    [
        ({1: 2}, {}, {}, {1: 2}, {1}),  # not judged yet since the restart: kept
        ({1: 2}, {1: 1.5}, {1: 1}, {1: 3}, {1}),  # a slow window continues the streak
        ({1: 2}, {1: 1.0}, {1: 0}, {1: 0}, set()),  # a normal window ends it
        ({}, {1: 1.5}, {1: 2}, {1: 2}, set()),
    ],
    ids=["unjudged", "continued", "ended", "nothing-carried"],
)
def test_carry_streaks(
    carried: dict[int, int],
    ratios: dict[int, float],
    streaks: dict[int, int],
    want: dict[int, int],
    still: set[int],
) -> None:
    got, left = carry_streaks(
        {r: state(r, n) for r, n in carried.items()}, detection(ratios, streaks)
    )
    assert {r: n for r, n in got.items()} == want and set(left) == still


WORKERS = [pod(f"qs-worker-{i}", "Running", ready=True, node=f"node-{i}") for i in range(3)]
EVICTED_EARLIER = Eviction(
    pod="qs-worker-2", node="node-2", rank=2, ratio=1.4, time=format_time(T0)
)


@pytest.mark.parametrize(
    ("spec", "evictions", "workers", "min_nodes", "reason", "evicts"),
    [
        (StragglerSpec(), [], WORKERS, 1, "StragglerEvicted", True),
        (StragglerSpec(action="alert"), [], WORKERS, 1, "StragglerAlerted", False),
        (
            StragglerSpec(cooldown_seconds=3600),
            [EVICTED_EARLIER],
            WORKERS,
            1,
            "StragglerFound",
            False,
        ),
        (
            StragglerSpec(cooldown_seconds=0, max_evictions_per_hour=1),
            [EVICTED_EARLIER],
            WORKERS,
            1,
            "StragglerFound",
            False,
        ),
        (
            StragglerSpec(cooldown_seconds=0, max_evictions_per_hour=2),
            [EVICTED_EARLIER],
            WORKERS,
            1,
            "StragglerEvicted",
            True,
        ),
        # minNodes 3 of 3: allowed, since every slot is up and the replacement comes at once...
        (StragglerSpec(), [], WORKERS, 3, "StragglerEvicted", True),
        # ...but not while another worker is missing.
        (StragglerSpec(), [], WORKERS[:2], 2, "StragglerFound", False),
    ],
    ids=[
        "evict",
        "alert",
        "cooldown",
        "hourly-budget",
        "budget-left",
        "min-nodes-replaced",
        "min-nodes",
    ],
)
def test_eviction_rules(
    spec: StragglerSpec,
    evictions: list[Eviction],
    workers: list[PodView],
    min_nodes: int,
    reason: str,
    evicts: bool,
) -> None:
    now = T0 + timedelta(minutes=20)
    d = decide_stragglers(
        spec, detection({0: 1.0, 1: 1.6, 2: 1.0}, {1: 3}), {}, [], None, evictions,
        workers, min_nodes, 3, now,
    )  # fmt: skip
    assert d.condition.status == "True" and d.condition.reason == reason
    assert "rank 1" in (d.condition.message or "") and "node-1" in (d.condition.message or "")
    assert (d.evict is not None) == evicts
    found = [e for e in d.events if e.reason == "StragglerFound"]
    assert len(found) == 1 and "1.60" in found[0].message and "qs-worker-1" in found[0].message
    if evicts:
        assert d.evict is not None and d.evict.name == "qs-worker-1"
        assert d.eviction == Eviction(
            pod="qs-worker-1", node="node-1", rank=1, ratio=1.6, time=format_time(now)
        )


@pytest.mark.parametrize(
    ("steps_left", "evicts"), [(None, True), (6, True), (5, False), (0, False)]
)
def test_no_eviction_within_a_window_of_the_end(steps_left: int | None, evicts: bool) -> None:
    """Evicting as the run ends cannot pay back the re-form, and a replacement joining a group
    that is finishing waits out torchrun's exit barrier: reported, not evicted."""
    spec = StragglerSpec(window_steps=5)
    d = decide_stragglers(
        spec, detection({0: 1.0, 1: 1.6, 2: 1.0}, {1: 3}), {}, [], None, [], WORKERS, 1, 3,
        T0, steps_left=steps_left,
    )  # fmt: skip
    assert d.condition.status == "True" and (d.evict is not None) == evicts
    if not evicts:
        assert d.condition.reason == "StragglerFound"
        assert f"training ends in {steps_left} steps" in (d.condition.message or "")


def test_no_straggler_and_unconfirmed_suspects() -> None:
    d = decide_stragglers(
        StragglerSpec(), detection({0: 1.0, 1: 1.3}, {1: 1}), {}, [], None, [], WORKERS, 1, 3, T0
    )
    assert d.condition.status == "False" and d.evict is None and d.events == ()
    assert [(s.rank, s.streak, s.confirmed) for s in d.stragglers] == [(1, 1, False)]
    off = decide_stragglers(
        StragglerSpec(enabled=False),
        detection({1: 2.0}, {1: 9}),
        {},
        [],
        None,
        [],
        WORKERS,
        1,
        3,
        T0,
    )
    assert off.condition.status == "False" and off.evict is None and off.stragglers == ()


def test_found_event_only_once() -> None:
    det = detection({0: 1.0, 1: 1.6}, {1: 4})
    spec = StragglerSpec(action="alert")
    old = [state(1, 3, confirmed=True)]
    d = decide_stragglers(spec, det, {}, old, None, [], WORKERS, 1, 3, T0)
    assert d.condition.reason == "StragglerAlerted" and d.events == ()


def hb(rank: int, step: int, heartbeat: float) -> RankSample:
    return replace(sample(rank, step, 0.2), heartbeat=heartbeat)


@pytest.mark.parametrize(
    ("samples", "before", "since", "judging", "hung", "reason"),
    [
        # Progress: the clock restarts.
        ([hb(0, 20, 1000), hb(1, 20, 1000)], 15, 0, True, False, "Progressing"),
        # A slow step still beats: no step change for 50 s but heartbeats are fresh.
        ([hb(0, 15, 1099), hb(1, 15, 1099)], 15, 50, True, False, "Progressing"),
        # Rank 1 stopped beating 70 s ago (timeout 60): hung.
        ([hb(0, 15, 1099), hb(1, 15, 1030)], 15, 50, True, True, "RankHung"),
        # Nobody's step advanced for 70 s although heartbeats look fresh.
        ([hb(0, 15, 1099), hb(1, 15, 1099)], 15, 70, True, True, "NoProgress"),
        # Not judged while the workers are not all up (a re-form is not a hang).
        ([hb(0, 15, 0), hb(1, 15, 0)], 15, 500, False, False, "Progressing"),
    ],
    ids=["progress", "slow-step", "stale-heartbeat", "no-progress", "not-judging"],
)
def test_decide_hang(
    samples: list[RankSample], before: int, since: int, judging: bool, hung: bool, reason: str
) -> None:
    now = datetime.fromtimestamp(1100, T0.tzinfo)
    last = format_time(now - timedelta(seconds=since))
    h = decide_hang(60, samples, before, max(s.step for s in samples), last, None,
                    judging=judging, now=now)  # fmt: skip
    assert h.hung == hung and h.condition.reason == reason
    if reason == "RankHung":
        assert "rank 1" in (h.condition.message or "") and "qs-worker-1" in (
            h.condition.message or ""
        )


# --- the whole pass: reconcile_job with scrapes -----------------------------------------------

SPEC = quickstart_raw()
SPEC["resources"].update(minNodes=1, maxNodes=3)
SPEC["faultTolerance"].update(
    stragglers={"windowSteps": 5, "consecutiveWindows": 2, "cooldownSeconds": 0},
    hangTimeoutSeconds=60,
)
PODS = [pod("qs-rdzv", "Running", ready=True), *WORKERS]


def run_pass(
    status: FineTuneJobStatus,
    pods: Sequence[PodView],
    samples: Sequence[RankSample],
    buffer: RecordBuffer | None,
    now: datetime,
    spec: dict[str, Any] = SPEC,
) -> Outcome:
    return reconcile_job(
        JOB, spec, status, pods, now,
        planner=lambda _: make_plan(3),
        ensured_generation=1,
        health=HealthInput(tuple(samples), buffer),
    )  # fmt: skip


def scrapes(n: int, slow: dict[int, float], per_pass: int = 3) -> list[RankSample]:
    """Cumulative counters after `n` passes of `per_pass` synchronous steps: every rank waits
    at the sync point for the slowest one."""
    compute = {r: 0.2 * slow.get(r, 1.0) for r in range(3)}
    slowest = max(compute.values())
    steps = per_pass * n
    return [
        replace(
            sample(r, steps, c, heartbeat=T0.timestamp() + 2 * n),
            wait_sum=(slowest - c + 0.005) * steps,
        )
        for r, c in compute.items()
    ]


def drive(
    slow: dict[int, float],
    passes: int,
    status: FineTuneJobStatus | None = None,
    spec: dict[str, Any] = SPEC,
) -> tuple[FineTuneJobStatus, RecordBuffer | None, list[Outcome]]:
    st = status or run_pass(FineTuneJobStatus(), PODS, [], None, T0, spec).status
    buf: RecordBuffer | None = None
    outs = []
    for n in range(1, passes + 1):
        out = run_pass(st, PODS, scrapes(n, slow), buf, T0 + timedelta(seconds=2 * n), spec)
        outs.append(out)
        st, buf = out.status.model_copy(update={"step": 3 * n}), out.buffer
        if out.actions.delete:
            break
    return st, buf, outs


def test_slow_rank_is_evicted_its_node_excluded_and_no_restart_spent() -> None:
    st, _, outs = drive({1: 1.5}, 30)
    last = outs[-1]
    assert [d.name for d in last.actions.delete] == ["qs-worker-1"]
    assert [e.pod for e in st.evictions] == ["qs-worker-1"] and st.excluded_nodes == ["node-1"]
    assert st.evictions[0].ratio is not None and st.evictions[0].ratio >= 1.4
    assert st.restarts == 0  # evictions do not spend maxRestarts
    assert cond(st, COND_STRAGGLER_DETECTED) == ("True", "StragglerEvicted")
    assert {e.reason for e in last.events} >= {"StragglerFound", "StragglerEvicted"}
    assert last.ratios[1] >= 1.4 and last.ratios[0] < 1.2
    # Next passes: the pod is terminating (nothing new, nothing counted), then gone: the
    # replacement is created with anti-affinity to the excluded node.
    going = [p if p.name != "qs-worker-1" else replace(p, terminating=True) for p in PODS]
    out = run_pass(st, going, [], None, T0 + timedelta(minutes=5))
    assert out.status.restarts == 0 and not out.actions.create
    gone = [p for p in PODS if p.name != "qs-worker-1"]
    out = run_pass(out.status, gone, [], None, T0 + timedelta(minutes=5, seconds=2))
    (replacement,) = out.actions.create
    assert replacement["metadata"]["name"] == "qs-worker-1"
    terms = replacement["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-1"]} in terms[0][
        "matchExpressions"
    ]
    assert out.status.restarts == 0


def test_a_straggler_confirmed_at_the_end_of_training_is_reported_not_evicted() -> None:
    """The same slow rank as above, in a job whose maxSteps falls one window after the pass
    that evicted it there."""
    _, _, outs = drive({1: 1.5}, 30)
    evicted_at = 3 * len(outs)  # the step of the evicting pass
    spec = {**SPEC, "training": {**SPEC["training"], "maxSteps": evicted_at + 3}}
    st, _, outs = drive({1: 1.5}, len(outs), spec=spec)
    assert not any(o.actions.delete for o in outs) and st.evictions == []
    assert cond(st, COND_STRAGGLER_DETECTED) == ("True", "StragglerFound")
    message = next(c.message for c in st.conditions if c.type == COND_STRAGGLER_DETECTED)
    assert "training ends in 3 steps" in (message or ""), message


def test_even_ranks_are_never_evicted() -> None:
    st, _, outs = drive({}, 40)
    assert all(not o.actions.delete for o in outs)
    assert st.evictions == [] and cond(st, COND_STRAGGLER_DETECTED) == ("False", "NoStraggler")
    assert outs[-1].ratios and max(outs[-1].ratios.values()) < 1.2


def test_alert_action_never_evicts() -> None:
    spec = SPEC["faultTolerance"]["stragglers"]
    spec["action"] = "alert"
    try:
        st, _, outs = drive({2: 1.6}, 30)
    finally:
        spec.pop("action")
    assert all(not o.actions.delete for o in outs)
    assert cond(st, COND_STRAGGLER_DETECTED) == ("True", "StragglerAlerted")
    assert [s.rank for s in st.stragglers if s.confirmed] == [2]
    assert sum(e.reason == "StragglerFound" for o in outs for e in o.events) == 1


def _passes_to_eviction(*, restart: bool, keep_status: bool) -> int:
    """Passes until rank 1 (1.5x) is evicted; with `restart`, the operator restarts (its
    buffer is lost) as soon as status shows a streak, and `keep_status` False also loses the
    streaks in status (what an operator keeping its state only in memory would have)."""
    st = run_pass(FineTuneJobStatus(), PODS, [], None, T0).status
    buf: RecordBuffer | None = None
    restarted = False
    for n in range(1, 80):
        out = run_pass(st, PODS, scrapes(n, {1: 1.5}), buf, T0 + timedelta(seconds=2 * n))
        if out.actions.delete:
            assert [d.name for d in out.actions.delete] == ["qs-worker-1"]
            return n
        st, buf = out.status.model_copy(update={"step": 3 * n}), out.buffer
        if restart and not restarted and any(x.streak >= 1 for x in st.stragglers):
            restarted, buf = True, None
            if not keep_status:
                st = st.model_copy(update={"stragglers": []})
    raise AssertionError("never evicted")


def test_streaks_survive_an_operator_restart() -> None:
    """The detection state lives in status.stragglers: an operator restarted mid-streak goes on
    from it instead of counting the windows again."""
    steady = _passes_to_eviction(restart=False, keep_status=True)
    carried = _passes_to_eviction(restart=True, keep_status=True)
    forgotten = _passes_to_eviction(restart=True, keep_status=False)
    assert carried < forgotten, (steady, carried, forgotten)


def test_hung_rank_restarts_the_workers_counted_as_a_restart() -> None:
    st = run_pass(FineTuneJobStatus(), PODS, [], None, T0).status
    now = T0 + timedelta(seconds=2)
    fresh = [hb(r, 9, now.timestamp()) for r in range(3)]
    out = run_pass(st, PODS, fresh, None, now)
    st = out.status.model_copy(update={"step": 9})
    assert cond(st, COND_HANG_DETECTED) == ("False", "Progressing") and st.last_progress_time
    later = now + timedelta(seconds=90)
    stuck = [
        hb(0, 9, later.timestamp() - 1),
        hb(1, 9, now.timestamp()),
        hb(2, 9, later.timestamp() - 1),
    ]
    out = run_pass(st, PODS, stuck, out.buffer, later)
    assert sorted(d.name for d in out.actions.delete) == [f"qs-worker-{i}" for i in range(3)]
    assert out.status.restarts == 1 and out.status.hangs == 1
    assert cond(out.status, COND_HANG_DETECTED) == ("True", "RankHung")
    (event,) = [e for e in out.events if e.reason == "HangDetected"]
    assert event.type == "Warning" and "rank 1" in event.message


def test_samples_read_the_page_the_trainer_really_serves() -> None:
    """The operator parses what TrainerMetrics exports (names from the one contract module)."""
    torch = pytest.importorskip("torch")
    from prometheus_client import generate_latest

    from finetune_trainer.metrics import StepStats, TrainerMetrics

    m = TrainerMetrics(job="qs", rank=2, device=torch.device("cpu"), reforms=1, total_steps=9)
    m.serve(None, None)
    for n in range(1, 4):
        m.observe_step(StepStats(n, 1.0, 1e-3, 64, 0.5, 0.3, 0.2), world_size=3)
    m.observe_checkpoint_committed(3, 0.1)
    (s,) = parse_rank_samples(generate_latest(m.registry).decode(), "qs-worker-2", "n")
    assert (s.rank, s.step, s.restarts, s.checkpoint_step, s.compute_count) == (2, 3, 1, 3, 3)
    assert s.compute_sum == pytest.approx(0.9) and s.wait_sum == pytest.approx(0.6)
    assert s.heartbeat is not None and s.heartbeat > 1.7e9


def test_a_hang_with_no_restart_left_fails_the_job() -> None:
    st = run_pass(FineTuneJobStatus(), PODS, [], None, T0).status
    now = T0 + timedelta(seconds=2)
    st = run_pass(st, PODS, [hb(r, 9, now.timestamp()) for r in range(3)], None, now).status
    st = st.model_copy(update={"step": 9, "restarts": 3})  # maxRestarts 3: all spent
    later = now + timedelta(seconds=90)
    out = run_pass(st, PODS, [hb(r, 9, now.timestamp()) for r in range(3)], None, later)
    assert cond(out.status, "Failed") == ("True", "BackoffLimitExceeded")
    assert out.status.phase == "Failed" and out.status.restarts == 3 and out.status.hangs == 1
    assert sorted(d.name for d in out.actions.delete) == [f"qs-worker-{i}" for i in range(3)]
    # The next pass sees a terminal job: the rendezvous pod goes too, nothing is re-created.
    again = run_pass(out.status, PODS, [], None, later + timedelta(seconds=2))
    assert not again.actions.create and again.status.phase == "Failed"


def test_a_streak_carried_for_an_evicted_pod_never_passes_to_the_pod_now_at_its_rank() -> None:
    """After an eviction the group re-forms and another pod takes the evicted rank: the streak
    status carried was the evicted pod's, so the new holder of the rank is not evicted for it
    (seen end to end before this rule: two evictions, the second of a healthy pod)."""
    replacement = pod("qs-worker-9", "Running", ready=True, node="node-9")
    workers = [WORKERS[0], WORKERS[2], replacement]
    carried = {1: state(1, 3, confirmed=True)}  # qs-worker-1's, evicted and gone
    # Right after the re-form rank 1 is qs-worker-2's and not judged yet.
    det = replace(
        detection({}, {}), pods={0: ("qs-worker-0", "node-0"), 1: ("qs-worker-2", "node-2")}
    )
    d = decide_stragglers(
        StragglerSpec(cooldown_seconds=0), det, carried, [], None, [], workers, 1, 3, T0
    )
    assert d.evict is None and not [s for s in d.stragglers if s.confirmed]
