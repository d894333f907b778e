"""The detector's inputs and outputs. Pure data; the trace format's camelCase keys map 1:1."""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune_operator.api.spec import StragglerSpec


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
    # When the trainer process started (unix seconds; traces only). A re-form that only adds
    # nodes keeps each survivor's pod, rank and restart count, but not its process.
    started: float | None = None
    checkpoint: bool = False  # this step saved a checkpoint
    steps: int = 1  # how many steps the record averages (1 in a trace)


@dataclass(frozen=True)
class Policy:
    """The spec's `faultTolerance.stragglers`, in the detector's terms (see `policy_from_spec`).

    `warmup_steps` and `min_coverage` are not in the spec: they are properties of the signal,
    not choices a job author makes."""

    threshold: float = 1.2
    window_steps: int = 20
    consecutive_windows: int = 3
    warmup_steps: int = 10  # ignored after each (re)start
    # A rank's window counts only if its records cover at least this share of the window's
    # steps; a window with less (dropped records) neither extends nor breaks a streak.
    min_coverage: float = 0.5

    def __post_init__(self) -> None:
        if not self.threshold > 1.0:
            raise ValueError(f"threshold must be > 1.0, got {self.threshold}")
        if self.window_steps < 1:
            raise ValueError(f"windowSteps must be >= 1, got {self.window_steps}")
        if self.consecutive_windows < 1:
            raise ValueError(f"consecutiveWindows must be >= 1, got {self.consecutive_windows}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 < self.min_coverage <= 1.0:
            raise ValueError(f"min_coverage must be in (0, 1], got {self.min_coverage}")


def policy_from_spec(spec: StragglerSpec) -> Policy:
    """The one mapping from `spec.faultTolerance.stragglers` to the detector's policy, shared by
    the operator and `ftjob stragglers --policy-from`. `enabled`, `action`, `cooldownSeconds`
    and `maxEvictionsPerHour` are the operator's decisions, not the detector's."""
    return Policy(
        threshold=spec.threshold,
        window_steps=spec.window_steps,
        consecutive_windows=spec.consecutive_windows,
    )


@dataclass(frozen=True)
class Verdict:
    """A rank found slow in `consecutive_windows` windows in a row."""

    rank: int
    pod: str | None  # the pod that held `rank` in the epoch where it was decided
    node: str | None
    ratio: float  # the rank's median compute over the other ranks' median, deciding window
    detected_at_step: int  # the last step of the deciding window
    window: int  # index of the deciding window since the end of the epoch's warm-up
    wait_ratio: float | None = None  # the rank's median wait over the others' (None: no wait)
    epoch_start_step: int = 0  # the first step of the (re-formed) group the verdict is about


@dataclass(frozen=True)
class Detection:
    """What `find_stragglers` found.

    `verdicts` are about the current epoch only (the group as it runs now, after its last
    re-form), so the operator can act on them; `earlier` holds the verdicts of earlier epochs
    (each naming the pod/node the rank had then), for the offline replay."""

    verdicts: tuple[Verdict, ...]
    ratios: dict[int, float]  # latest evaluated window's compute ratio per rank (current epoch)
    streaks: dict[int, int]  # consecutive slow windows per rank at the end (current epoch)
    earlier: tuple[Verdict, ...] = ()
    epoch_start_step: int = 0  # first step of the current epoch
    windows: int = 0  # complete windows evaluated in the current epoch
    # rank -> (pod, node) in the current epoch
    pods: dict[int, tuple[str | None, str | None]] = field(default_factory=dict)

    @property
    def all_verdicts(self) -> tuple[Verdict, ...]:
        return self.earlier + self.verdicts
