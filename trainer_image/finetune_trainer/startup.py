"""The trainer's cold start, by phase: how long from the process starting to its first step,
and where the time went (imports, process group, data, model, resume, first step). After a
worker dies every rank starts cold again, so this is most of a recovery; it is logged once,
at the first step, for operators to read off a real cluster.

The process start comes from the kernel (`/proc/self/stat`), so the interpreter's own start
and the imports before this module runs are counted; where /proc is absent the clock starts
when this module is imported."""

from __future__ import annotations

import os
import time
from pathlib import Path

PHASES = ("imports", "group", "data", "model", "resume", "first step")


def process_age_seconds(stat: str, uptime: str, ticks_per_second: int) -> float:
    """Seconds since the process started, from `/proc/self/stat` and `/proc/uptime`. The
    command name (field 2) may hold spaces and parentheses: fields are counted after its
    closing parenthesis; starttime is field 22, in clock ticks since boot."""
    after_comm = stat[stat.rindex(")") + 2 :].split()
    start_ticks = int(after_comm[22 - 3])
    return max(0.0, float(uptime.split()[0]) - start_ticks / ticks_per_second)


def _process_start_monotonic() -> float:
    now = time.monotonic()
    try:
        age = process_age_seconds(
            Path("/proc/self/stat").read_text(),
            Path("/proc/uptime").read_text(),
            os.sysconf("SC_CLK_TCK"),
        )
    except (OSError, ValueError, IndexError):
        return now
    return now - age


class StartupClock:
    """Marks the end of each phase; `summary()` once the first step is done."""

    def __init__(self, started_at: float | None = None) -> None:
        self.started_at = _process_start_monotonic() if started_at is None else started_at
        self.marks: dict[str, float] = {}
        self.notes: dict[str, str] = {}

    def mark(self, phase: str, at: float | None = None, *, note: str | None = None) -> None:
        """`note`: how the phase went, shown beside its time (e.g. the data's `cache hit`)."""
        if phase not in PHASES:
            raise ValueError(f"unknown startup phase {phase!r}; known: {PHASES}")
        self.marks.setdefault(phase, time.monotonic() if at is None else at)
        if note:
            self.notes.setdefault(phase, note)

    def durations(self) -> dict[str, float]:
        """Each marked phase's own seconds, in PHASES order (a phase runs from the previous
        mark to its own)."""
        out: dict[str, float] = {}
        previous = self.started_at
        for phase in PHASES:
            if phase in self.marks:
                out[phase] = self.marks[phase] - previous
                previous = self.marks[phase]
        return out

    def summary(self, cpu_seconds: float | None = None) -> str:
        """`cpu_seconds`: the process's CPU time so far; far below the wall time, the start
        waited (for peers, storage, or a CPU shared with other processes)."""
        durations = self.durations()
        total = sum(durations.values())
        parts = ", ".join(
            f"{phase} {seconds:.2f}" + (f" ({self.notes[phase]})" if phase in self.notes else "")
            for phase, seconds in durations.items()
        )
        cpu = "" if cpu_seconds is None else f" (cpu {cpu_seconds:.2f} s)"
        return f"started in {total:.2f} s{cpu}: {parts}"
