"""The detector's inputs and outputs. Pure data; the trace format's camelCase keys map 1:1."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    """One rank's timing for one step (or, from a live scrape, the mean over `steps` steps
    that ended at `step`): the trace format's line, and what the operator builds from
    successive scrapes of a rank's compute/wait histograms."""

    step: int
    rank: int
    compute_seconds: float
    wait_seconds: float = 0.0
    pod: str | None = None
    node: str | None = None
    restart: int = 0  # torchelastic restart count: a change means the group re-formed
    checkpoint: bool = False  # this step saved a checkpoint
    steps: int = 1  # how many steps the record averages (1 in a trace)


@dataclass(frozen=True)
class Policy:
    """The spec's `faultTolerance.stragglers`, in the detector's terms."""

    threshold: float = 1.2
    window_steps: int = 20
    consecutive_windows: int = 3
    warmup_steps: int = 10  # ignored after each (re)start


@dataclass(frozen=True)
class Verdict:
    """A rank found slow in `consecutive_windows` windows in a row."""

    rank: int
    pod: str | None
    node: str | None
    ratio: float  # the rank's median compute over the cross-rank median, last window
    detected_at_step: int  # the last step of the deciding window
    window: int  # index of the deciding window since the last (re)start
    wait_ratio: float | None = None  # the rank's wait over the others' median wait
