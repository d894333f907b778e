"""A re-form never makes a straggler verdict about a survivor: the group's records before a
membership change are never judged without the rank that left, a trainer process is told
apart from its successor even when its counters have passed the old ones, and the new group
is judged only on its own steps after its warm-up.

Seen end to end before these rules (cooldownSeconds 0): right after the straggler's eviction a
healthy survivor was evicted with a ratio ~2, its old group's windows re-judged against the
other survivor alone, whose waits were waits for the evicted rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

import pytest

from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import Outcome, PodView, RecordBuffer
from finetune_operator.reconcile.samples import RankSample, advance, parse_rank_samples
from tests.operator.test_health import PODS, run_pass
from tests.operator.test_reconcile import T0, pod

# Per-step compute seconds in the old group: rank 1 is the straggler; rank 0 sits at the
# group's median, rank 2 is the fastest. Against rank 2 alone rank 0 reads 1.3x.
OLD_GROUP = {0: 0.26, 1: 0.34, 2: 0.2}
STEPS_PER_PASS = 3


@dataclass
class Trainer:
    """One trainer process's cumulative counters, as its metrics page reports them."""

    pod: str
    node: str
    rank: int
    restarts: int = 0
    started: float = 1000.0  # the process start time on its page
    step: int = 0
    count: int = 0
    compute: float = 0.0
    wait: float = 0.0

    def sample(self, now: float) -> RankSample:
        return RankSample(
            rank=self.rank, pod=self.pod, node=self.node, step=self.step,
            restarts=self.restarts, heartbeat=now, started=self.started,
            compute_sum=self.compute, compute_count=self.count,
            wait_sum=self.wait, wait_count=self.count,
        )  # fmt: skip


def train(group: list[Trainer], compute: dict[int, float], steps: int) -> None:
    """Synchronous steps: every rank waits at the sync point for the slowest one."""
    slowest = max(compute[t.rank] for t in group)
    for t in group:
        t.step += steps
        t.count += steps
        t.compute += compute[t.rank] * steps
        t.wait += (slowest - compute[t.rank] + 0.005) * steps


class Run:
    """reconcile_job passes, every 2 s, carrying status and the record buffer."""

    def __init__(self) -> None:
        self.now = T0
        self.status = run_pass(FineTuneJobStatus(), PODS, [], None, T0).status
        self.buffer: RecordBuffer | None = None
        self.outcomes: list[Outcome] = []

    def step(self, pods: list[PodView], scraped: list[Trainer]) -> Outcome:
        self.now += timedelta(seconds=2)
        samples = [t.sample(self.now.timestamp()) for t in scraped]
        out = run_pass(self.status, pods, samples, self.buffer, self.now)
        step = max((t.step for t in scraped), default=self.status.step)
        self.status = out.status.model_copy(update={"step": step})
        self.buffer = out.buffer
        self.outcomes.append(out)
        return out


def evict_the_straggler(run: Run) -> list[Trainer]:
    old = [Trainer(f"qs-worker-{r}", f"node-{r}", r) for r in range(3)]
    for _ in range(40):
        train(old, OLD_GROUP, STEPS_PER_PASS)
        if run.step(PODS, old).actions.delete:
            break
    assert [d.name for d in run.outcomes[-1].actions.delete] == ["qs-worker-1"]
    assert [e.rank for e in run.status.evictions] == [1]
    return old


def test_a_survivor_is_never_evicted_while_and_after_the_group_re_forms() -> None:
    run = Run()
    old = evict_the_straggler(run)
    evicted_at = len(run.outcomes)
    survivors = [old[0], old[2]]
    rdzv, w0, w1, w2 = PODS
    # The evicted pod stops (its stop step is saved): the survivors' old processes still
    # finish a step with it, then exit; torchelastic restarts them in the new group.
    going = [rdzv, w0, replace(w1, terminating=True), w2]
    train(old, OLD_GROUP, 1)
    run.step(going, survivors)
    train(survivors, {0: 0.26, 2: 0.2}, 1)  # a late scrape of the dying processes
    run.step(going, survivors)
    # The replacement (same name, another node) comes up while the survivors rendezvous.
    for phase, ready in (("Pending", False), ("Running", True), ("Running", True)):
        replacement = pod("qs-worker-1", phase, ready=ready, node="node-9")
        run.step([rdzv, w0, replacement, w2], [])
    # The new group: the survivors with their restart count bumped and ranks reassigned,
    # everyone resumed from the stop step's checkpoint and slow for the first steps.
    resumed = old[0].step
    new = [
        Trainer("qs-worker-0", "node-0", 0, restarts=1, started=2000.0, step=resumed),
        Trainer("qs-worker-2", "node-2", 1, restarts=1, started=2000.0, step=resumed),
        Trainer("qs-worker-1", "node-9", 2, restarts=0, started=2000.0, step=resumed),
    ]
    pods = [rdzv, w0, pod("qs-worker-1", "Running", ready=True, node="node-9"), w2]
    run.step(pods, new)  # first scrape, before the first step
    train(new, {0: 2.5, 1: 1.0, 2: 1.5}, 2)  # warm-up: checkpoint load, allocator, caches
    for _ in range(15):
        train(new, {0: 0.2, 1: 0.2, 2: 0.2}, STEPS_PER_PASS)
        run.step(pods, new)
    after = run.outcomes[evicted_at:]
    deleted = [d.name for o in after for d in o.actions.delete]
    assert deleted == [], [(s.rank, s.pod, s.ratio, s.streak) for s in run.status.stragglers]
    assert len(run.status.evictions) == 1
    # Still watching: the new group is judged (each rank's ratio), and found even.
    assert set(after[-1].ratios) == {0, 1, 2} and max(after[-1].ratios.values()) < 1.2
    assert not any(s.confirmed for s in run.status.stragglers)


def test_a_straggler_in_the_re_formed_group_is_still_found() -> None:
    """The new group is judged from its own records: a slow rank there is evicted too."""
    run = Run()
    old = evict_the_straggler(run)
    rdzv, w0, _, w2 = PODS
    replacement = pod("qs-worker-1", "Running", ready=True, node="node-9")
    pods = [rdzv, w0, replacement, w2]
    run.step(pods, [])
    new = [
        Trainer("qs-worker-0", "node-0", 0, restarts=1, started=2000.0, step=old[0].step),
        Trainer("qs-worker-2", "node-2", 1, restarts=1, started=2000.0, step=old[0].step),
        Trainer("qs-worker-1", "node-9", 2, started=2000.0, step=old[0].step),
    ]
    run.step(pods, new)
    for _ in range(30):
        train(new, {0: 0.2, 1: 0.32, 2: 0.2}, STEPS_PER_PASS)
        if run.step(pods, new).actions.delete:
            break
    assert [d.name for d in run.outcomes[-1].actions.delete] == ["qs-worker-2"]
    assert [e.pod for e in run.status.evictions] == ["qs-worker-1", "qs-worker-2"]


def test_a_new_process_is_told_from_the_old_one_when_its_counters_passed_them() -> None:
    """A scale-up re-form restarts the survivors' trainers without bumping torchelastic's
    restart count, and the rank may stay the same: only the process start time on the page tells
    the new process from the old. Its counters (8 steps) already passed the old process's
    (3 steps, a short-lived smaller group): no record may span the two."""
    torch = pytest.importorskip("torch")
    from prometheus_client import generate_latest

    from finetune_trainer.metrics import StepStats, TrainerMetrics

    def page(m: TrainerMetrics, steps: list[float]) -> str:
        for n, c in enumerate(steps, start=1):
            m.observe_step(StepStats(n, 1.0, 1e-3, 64, c + 0.1, c, 0.1), world_size=2)
        return generate_latest(m.registry).decode()

    def process() -> TrainerMetrics:  # a new trainer process: its start time is now
        return TrainerMetrics(
            job="qs", rank=0, device=torch.device("cpu"), reforms=1, total_steps=99
        )

    (old,) = parse_rank_samples(page(process(), [0.2] * 3), "qs-worker-0", "node-0")
    (new,) = parse_rank_samples(page(process(), [3.0, 1.0] + [0.2] * 6), "qs-worker-0", "node-0")
    assert new.compute_count > old.compute_count and new.restarts == old.restarts
    assert old.process != new.process
    live = {"qs-worker-0": "node-0"}
    buf = advance(RecordBuffer(), [old], live, keep_steps=100)
    buf = advance(buf, [new], live, keep_steps=100)
    assert buf.records == () and buf.last[0] == new
