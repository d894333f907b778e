"""What a rank publishes at the start-up barrier and how its peers judge it (pure).

The barrier itself (startup_barrier.py) is the I/O around these: every heartbeat a rank sets
its beat key to `encode_beat` of its `Beat`; a waiting rank reads every rank's key, `observe`s
the values on its own clock, and acts on the `verdict`. Only published values are compared,
never the clocks of different hosts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

READY = "ready"  # a beat key's value once its rank arrived
Verdict = Literal["go", "wait", "lost", "stuck", "too long"]


class StartupStalledError(RuntimeError):
    """This rank's start-up work made no progress for its phase's stall limit: it ends, and
    its pod's failure is its own (not a lost peer's)."""


@dataclass(frozen=True)
class Beat:
    """One rank's published beat: its `count` (changes every heartbeat: alive), its phase and
    progress count (startup_progress.py), and how long that progress may stand still
    (`stall_s`, the rank's own `stall_limit` for its phase). `ready`: it arrived."""

    count: int
    phase: str = ""
    progress: int = 0
    stall_s: float = 0.0
    ready: bool = False


def encode_beat(beat: Beat) -> str:
    """Pure: a beat key's value (the phase last: it may hold spaces)."""
    if beat.ready:
        return READY
    return f"{beat.count} {beat.progress} {beat.stall_s:.3f} {beat.phase}"


def decode_beat(value: bytes) -> Beat:
    """Pure: `encode_beat`'s inverse."""
    text = value.decode()
    if text == READY:
        return Beat(0, ready=True)
    try:
        count, progress, stall_s, phase = text.split(" ", 3)
        return Beat(int(count), phase, int(progress), float(stall_s))
    except ValueError as e:
        raise ValueError(f"start-up barrier: a beat {text!r} not of this trainer's format "
                         "(a trainer of another version in the group?)") from e  # fmt: skip


@dataclass(frozen=True)
class PeerView:
    """A rank's beat as last read, when (the reader's clock) its count last changed, and
    when its phase or progress last did."""

    beat: Beat | None
    changed_at: float
    progressed_at: float


def observe(views: Sequence[PeerView], beats: Sequence[Beat | None], now: float) -> list[PeerView]:
    """Pure: the views after reading `beats` (None: the rank has not beaten yet)."""
    after = []
    for view, beat in zip(views, beats, strict=True):
        old = view.beat
        if beat == old:
            after.append(view)
            continue
        moved = (
            old is None or beat is None or (beat.phase, beat.progress) != (old.phase, old.progress)
        )
        after.append(PeerView(beat, now, now if moved else view.progressed_at))
    return after


def missing_ranks(views: Sequence[PeerView]) -> list[int]:
    """Pure: the ranks that have not arrived (not beaten yet, or beating)."""
    return [r for r, v in enumerate(views) if v.beat is None or not v.beat.ready]


def is_stuck(progressed_at: float, now: float, limit: float) -> bool:
    """Pure: progress last seen moving at `progressed_at` has stood still past `limit`."""
    return now - progressed_at > limit


def verdict(
    views: Sequence[PeerView],
    now: float,
    *,
    started: float,
    stale_after: float,
    limit: float,
    grace: float = 0.0,
) -> tuple[Verdict, int | None]:
    """Pure: `go` once every rank arrived; `lost` (and the rank) when a missing rank's beat
    has not changed for `stale_after`; `stuck` when one beats but its progress has not moved
    for its stall limit plus `grace`; `too long` (and a missing rank) past `limit` since
    `started`; else `wait`."""
    missing = missing_ranks(views)
    if not missing:
        return "go", None
    for rank in missing:
        if now - views[rank].changed_at > stale_after:
            return "lost", rank
    for rank in missing:
        beat = views[rank].beat
        if beat is not None and is_stuck(views[rank].progressed_at, now, beat.stall_s + grace):
            return "stuck", rank
    if now - started > limit:
        return "too long", missing[0]
    return "wait", None
