"""The scheduler's event recorder (events.py): repeats aggregated as client-go's events
broadcaster aggregates them. Pure, quick."""

from __future__ import annotations

from typing import Any

from finetune_local.events import FINISH_SECONDS, REFRESH_SECONDS, SeriesCache


def _event(pod: str, message: str, reason: str = "FailedScheduling") -> dict[str, Any]:
    return {
        "metadata": {"name": f"{pod}.1", "namespace": "default"},
        "involvedObject": {"kind": "Pod", "namespace": "default", "name": pod, "uid": pod},
        "reason": reason,
        "message": message,
        "type": "Warning",
        "action": "Scheduling",
        "reportingComponent": "default-scheduler",
    }


def test_a_repeat_starts_a_series_at_once_and_later_ones_are_counted_in_memory() -> None:
    cache = SeriesCache()
    first = cache.observe(_event("p", "0/3 nodes: 3 Insufficient cpu."), 100.0)
    assert first is not None and first.series is None  # created
    second = cache.observe(_event("p", "0/3 nodes: 3 Insufficient cpu."), 101.0)
    assert second is not None and second.series is not None
    assert second.series["count"] == 2
    assert second.series["lastObservedTime"].endswith(".000000Z")
    # Another message for the same pod and reason is the same series, as in client-go.
    assert cache.observe(_event("p", "0/3 nodes: 3 Too many pods."), 102.0) is None
    assert cache.observe(_event("p", "0/3 nodes: 3 Too many pods."), 103.0) is None
    # Another pod, or another reason, is another event.
    other = cache.observe(_event("q", "0/3 nodes: 3 Insufficient cpu."), 103.0)
    assert other is not None and other.series is None
    assert cache.observe(_event("p", "x", reason="Scheduled"), 103.0) is not None


def test_series_are_refreshed_every_30_minutes_and_finished_after_6_quiet_ones() -> None:
    cache = SeriesCache()
    assert cache.due(0.0) == []
    for at in range(4):
        cache.observe(_event("busy", "m"), float(at))
    cache.observe(_event("lone", "m"), 0.0)
    # 6 minutes on: the busy series, quiet since t=3, is written with its last count (4) and
    # forgotten; the lone event is forgotten.
    writes = cache.due(FINISH_SECONDS + 3.0)
    assert [(w.event["involvedObject"]["name"], w.series) for w in writes] == [
        ("busy", {"count": 4, "lastObservedTime": "1970-01-01T00:00:03.000000Z"})
    ]
    again = cache.observe(_event("busy", "m"), FINISH_SECONDS + 4.0)
    assert again is not None and again.series is None  # a new event, not the old series
    # A series still going is written on the 30-minute refresh.
    for at in range(5):
        cache.observe(_event("busy", "m"), REFRESH_SECONDS - 10.0 + at)
    refreshed = [w for w in cache.due(REFRESH_SECONDS) if w.series]
    assert [w.series["count"] for w in refreshed if w.series] == [6]
