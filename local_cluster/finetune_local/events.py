"""An event recorder that aggregates repeats as kube-scheduler's does (client-go's
``tools/events`` broadcaster, which the scheduler uses wherever the API serves
``events.k8s.io/v1``, as every current one does).

Events are isomorphic when they share type, action, reason, reporting component and the object
they regard; the message is *not* part of it. The first one is created. The second starts a
series: the stored Event is patched at once with ``series: {count: 2, lastObservedTime}``.
Later repeats only count in memory; the count reaches the API server when the series is
refreshed (every 30 minutes) or finished (6 minutes after its last repeat, checked every 6
minutes). A finished series, or a lone event 6 minutes old, leaves the cache: its next repeat
is a new Event. A patch that finds the Event gone (expired, deleted) creates it again.

So an unschedulable pod retried many times shows one FailedScheduling Event, with the message
of its first attempt and ``series.count`` 2 from its second: what ``kubectl get events``
shows on a real cluster; the pod's PodScheduled condition carries the latest message.
:class:`SeriesCache` decides, :class:`EventRecorder` writes.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from finetune_local.restclient import ApiStatusError, RestClient, resource_path

FINISH_SECONDS = 6 * 60
REFRESH_SECONDS = 30 * 60
Clock = Callable[[], float]
Key = tuple[str, ...]


def series_key(event: dict[str, Any]) -> Key:
    """What makes two events one series (client-go's getKey: no message in it)."""
    regarding = event.get("involvedObject") or {}
    return (
        event.get("type", ""),
        event.get("action", ""),
        event.get("reason", ""),
        event.get("reportingComponent", ""),
        *(
            str(regarding.get(k, ""))
            for k in ("kind", "namespace", "name", "uid", "apiVersion", "fieldPath")
        ),
    )


def micro_time(moment: float) -> str:
    """A MicroTime, as ``series.lastObservedTime`` is written."""
    stamp = datetime.datetime.fromtimestamp(moment, datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class _Cached:
    event: dict[str, Any]
    observed_at: float
    count: int = 1  # 1: a lone event, no series yet
    written_count: int = 1


@dataclass
class Write:
    """One call to the API server: create ``event``, or patch its series (and create it again
    if it is gone)."""

    event: dict[str, Any]
    series: dict[str, Any] | None = None


@dataclass
class SeriesCache:
    """The recorder's memory of recent events (pure: time comes in as an argument)."""

    entries: dict[Key, _Cached] = field(default_factory=dict)
    refreshed_at: float | None = None
    finished_at: float | None = None

    def observe(self, event: dict[str, Any], at: float) -> Write | None:
        """What to write for one more occurrence of ``event`` (None: only counted here)."""
        key = series_key(event)
        cached = self.entries.get(key)
        if cached is None:
            self.entries[key] = _Cached(copy.deepcopy(event), at)
            return Write(copy.deepcopy(event))
        cached.count += 1
        cached.observed_at = at
        if cached.count > 2:
            return None
        cached.written_count = 2
        return Write(copy.deepcopy(cached.event), self._series(cached))

    def due(self, at: float) -> list[Write]:
        """The periodic writes: every series refreshed each 30 minutes; each 6 minutes, series
        quiet for 6 minutes written a last time and forgotten, lone old events forgotten."""
        self.refreshed_at = at if self.refreshed_at is None else self.refreshed_at
        self.finished_at = at if self.finished_at is None else self.finished_at
        writes: list[Write] = []
        if at - self.finished_at >= FINISH_SECONDS:
            self.finished_at = at
            for key, cached in list(self.entries.items()):
                if at - cached.observed_at < FINISH_SECONDS:
                    continue
                if cached.count > 1 and cached.count != cached.written_count:
                    writes.append(Write(copy.deepcopy(cached.event), self._series(cached)))
                del self.entries[key]
        if at - self.refreshed_at >= REFRESH_SECONDS:
            self.refreshed_at = at
            for cached in self.entries.values():
                if cached.count > 1:
                    cached.written_count = cached.count
                    writes.append(Write(copy.deepcopy(cached.event), self._series(cached)))
        return writes

    @staticmethod
    def _series(cached: _Cached) -> dict[str, Any]:
        return {"count": cached.count, "lastObservedTime": micro_time(cached.observed_at)}


class EventRecorder:
    """Writes events through ``client`` as :class:`SeriesCache` says."""

    def __init__(self, client: RestClient, clock: Clock = time.time) -> None:
        self.client, self.clock = client, clock
        self.cache = SeriesCache()

    async def record(self, event: dict[str, Any]) -> None:
        write = self.cache.observe(event, self.clock())
        if write is not None:
            await self._write(write)

    async def flush(self) -> None:
        """The refresh and finish of series that are due (called on each kubelet pass)."""
        for write in self.cache.due(self.clock()):
            await self._write(write)

    async def _write(self, write: Write) -> None:
        meta = write.event["metadata"]
        path = resource_path("v1", "events", meta["namespace"])
        with contextlib.suppress(ApiStatusError):
            if write.series is not None:
                try:
                    await self.client.merge_patch(
                        resource_path("v1", "events", meta["namespace"], meta["name"]),
                        {"series": write.series},
                    )
                    return
                except ApiStatusError as err:
                    if err.status != 404:
                        raise
                await self.client.create(path, {**write.event, "series": write.series})
                return
            await self.client.create(path, write.event)
