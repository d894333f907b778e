"""Per-rank step records from successive scrapes of the trainers' metrics (pure).

Each pass scrapes every rank's cumulative compute/wait histograms; the difference between two
scrapes of the same process is one `StepRecord` averaging the steps in between. A record is only
made between two scrapes of the same trainer process: a changed pod or node, a changed
torchelastic restart count, a changed process start time (a new process, even where
torchelastic kept the restart count: it does on a membership change) or a counter that went
down starts afresh.

A re-form of the group restarts the window for every rank (`advance`): the records of a group
are only ever judged within that group. Timings taken with a rank that has left are not
compared without it (the survivors' waits were waits for it), and the survivors' old
processes, which still finish a step or two with the leaving rank, make no more records.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from finetune_operator.api import metricnames as mn
from finetune_operator.api.status import StragglerState
from finetune_operator.stragglers.types import StepRecord

# Samples read from a page, by exposed sample name.
_COMPUTE_SUM = f"{mn.TRAINER_COMPUTE_DURATION.name}_sum"
_COMPUTE_COUNT = f"{mn.TRAINER_COMPUTE_DURATION.name}_count"
_WAIT_SUM = f"{mn.TRAINER_WAIT_DURATION.name}_sum"
_WAIT_COUNT = f"{mn.TRAINER_WAIT_DURATION.name}_count"
_FIELDS = {
    mn.TRAINER_STEP.name: "step",
    mn.TRAINER_REFORMS.name: "restarts",
    mn.TRAINER_LAST_CHECKPOINT_STEP.name: "checkpoint_step",
    mn.TRAINER_HEARTBEAT.name: "heartbeat",
    _COMPUTE_SUM: "compute_sum",
    _COMPUTE_COUNT: "compute_count",
    _WAIT_SUM: "wait_sum",
    _WAIT_COUNT: "wait_count",
    mn.TRAINER_PROCESS_START.name: "started",
}

Process = tuple[str, str | None, int, int, float | None]


@dataclass(frozen=True)
class RankSample:
    """One rank's cumulative counters at one scrape, and where it runs."""

    rank: int
    pod: str
    node: str | None
    step: int = 0
    restarts: int = 0
    checkpoint_step: int = 0
    heartbeat: float | None = None  # unix time of the loop's last beat
    compute_sum: float = 0.0
    compute_count: float = 0.0
    wait_sum: float = 0.0
    wait_count: float = 0.0
    started: float | None = None  # the process's start time (None: not on the page)

    @property
    def process(self) -> Process:
        """Same value on two scrapes → same trainer process of the same group. The node is part
        of it: a replacement pod keeps its predecessor's name (worker-<i>), not its node."""
        return (self.pod, self.node, self.rank, self.restarts, self.started)


def parse_rank_samples(text: str, pod: str, node: str | None) -> list[RankSample]:
    """The ranks one metrics page reports (by their `rank` label); nothing if unparsable."""
    values: dict[int, dict[str, float]] = {}
    try:
        samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    except (ValueError, TypeError, IndexError):
        return []
    for s in samples:
        key = _FIELDS.get(s.name)
        if key is None or not math.isfinite(s.value):
            continue
        try:
            rank = int(s.labels.get(mn.LABEL_RANK, ""))
        except ValueError:
            continue
        values.setdefault(rank, {})[key] = s.value
    out = []
    for rank, v in sorted(values.items()):
        if "compute_count" not in v:
            continue  # not a trainer page
        out.append(
            RankSample(
                rank=rank,
                pod=pod,
                node=node,
                step=int(v.get("step", 0)),
                restarts=int(v.get("restarts", 0)),
                checkpoint_step=max(0, int(v.get("checkpoint_step", 0))),
                heartbeat=v.get("heartbeat") or None,
                compute_sum=v.get("compute_sum", 0.0),
                compute_count=v["compute_count"],
                wait_sum=v.get("wait_sum", 0.0),
                wait_count=v.get("wait_count", 0.0),
                started=v.get("started"),
            )
        )
    return out


def record_between(before: RankSample, after: RankSample) -> StepRecord | None:
    """The mean step of `after`'s process since `before` (None: nothing new, or not the same
    process — a counter reset, a re-form, another pod)."""
    if before.process != after.process:
        return None
    steps = after.compute_count - before.compute_count
    if steps <= 0 or after.compute_sum < before.compute_sum:
        return None
    waits = after.wait_count - before.wait_count
    wait = (after.wait_sum - before.wait_sum) / waits if waits > 0 else 0.0
    return StepRecord(
        step=after.step,
        rank=after.rank,
        compute_seconds=(after.compute_sum - before.compute_sum) / steps,
        wait_seconds=max(0.0, wait),
        pod=after.pod,
        node=after.node,
        restart=after.restarts,
        checkpoint=after.checkpoint_step > before.checkpoint_step,
        steps=int(steps),
    )


@dataclass(frozen=True)
class RecordBuffer:
    """A job's rolling detection input: the last sample of each rank, and recent records."""

    last: Mapping[int, RankSample] = field(default_factory=dict)
    records: tuple[StepRecord, ...] = ()
    # Straggler streaks read from status when this operator started (see carry_streaks).
    carried: Mapping[int, StragglerState] = field(default_factory=dict)
    # Processes of groups that re-formed, with their step count then: they make no records.
    retired: Mapping[Process, float] = field(default_factory=dict)


def _restarted(before: RankSample | None, after: RankSample) -> bool:
    return before is not None and (
        before.process != after.process or after.compute_count < before.compute_count
    )


def _is_retired(s: RankSample, retired: Mapping[Process, float]) -> bool:
    # A counter below the one seen at retirement is a new process of the same identity
    # (a page without the process start time).
    count = retired.get(s.process)
    return count is not None and s.compute_count >= count


def advance(
    buffer: RecordBuffer,
    samples: Sequence[RankSample],
    live_pods: Mapping[str, str | None],
    keep_steps: int,
) -> RecordBuffer:
    """The buffer after one more scrape (`live_pods`: the live worker pods and their nodes).
    Records older than `keep_steps` steps before the newest are dropped (bounded memory
    whatever the run's length); a rank missing from this scrape (a timeout) keeps its last
    sample.

    A re-form restarts the records of every rank: a rank's process changed (the group
    re-formed, or the rank moved to another pod), or a pod whose samples or records the buffer
    holds went away or was replaced (the group re-forms without it; torchelastic restarts every
    worker on a membership change). Every process seen before it is retired: its later samples
    (the old group finishing its last steps) make no records."""

    # A pod on another node than its samples' is a replacement of the same name (worker-<i>),
    # scheduled or not: what its predecessor reported (an evicted straggler, say) is not its own.
    def current(pod: str | None, node: str | None) -> bool:
        return pod is not None and pod in live_pods and live_pods[pod] == node

    fresh = [s for s in samples if current(s.pod, s.node) and not _is_retired(s, buffer.retired)]
    left = any(not current(s.pod, s.node) for s in buffer.last.values()) or any(
        not current(r.pod, r.node) for r in buffer.records
    )
    if left or any(_restarted(buffer.last.get(s.rank), s) for s in fresh):
        return _re_formed(buffer, fresh, live_pods)
    last = {**buffer.last, **{s.rank: s for s in fresh}}
    new = [r for s in fresh if s.rank in buffer.last for r in _one(buffer.last[s.rank], s)]
    records = (*buffer.records, *new)
    newest = max((r.step for r in records), default=0)
    kept = tuple(r for r in records if r.step > newest - keep_steps)
    carried = {r: c for r, c in buffer.carried.items() if c.pod in live_pods}
    return RecordBuffer(last, kept, carried, buffer.retired)


def _re_formed(
    buffer: RecordBuffer, fresh: Sequence[RankSample], live_pods: Mapping[str, str | None]
) -> RecordBuffer:
    """A new window for every rank: no records, no carried streaks (the old group's), the
    processes seen so far retired, and the samples of new processes as the starting point."""
    retired = {
        **{p: n for p, n in buffer.retired.items() if p[0] in live_pods},
        **{s.process: s.compute_count for s in buffer.last.values() if s.pod in live_pods},
    }
    # A pod that runs a new process now cannot run its older ones again: forget those.
    renewed = {s.pod for s in fresh if s.process not in retired}
    retired = {p: n for p, n in retired.items() if p[0] not in renewed}
    start = {s.rank: s for s in fresh if not _is_retired(s, retired)}
    return RecordBuffer(last=start, retired=retired)


def _one(before: RankSample, after: RankSample) -> Iterable[StepRecord]:
    record = record_between(before, after)
    return (record,) if record is not None else ()
