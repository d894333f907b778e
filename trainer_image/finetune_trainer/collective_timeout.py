"""The training group's collective timeout through a run: generous while the run starts and
around checkpoint saves, a few step times once it is warm (`api/elastic_timeouts.py` derives
both from the job).

Why phases: a silent peer loss (power loss, partition: the sockets stay open) costs the
survivors exactly this timeout before they fail and torchrun re-forms the group, so steady
training wants it short; but the first steps compile the blocks and initialise lazily (minutes
on a large model, different per rank), and around a save rank 0 commits and purges while its
peers already wait in the next step's collectives. Those keep the startup timeout.

The timeout is torch's per-process-group default, changed with `_set_pg_timeout` (gloo: each
later collective's timeout; NCCL: the watchdog's limit for each work enqueued afterwards). It
is a private torch function: where it is missing, the startup timeout stays for the whole run.

A download while starting (a dataset copy: one local rank of each pod fetches the whole corpus
from object storage, data/remote.py) is not in the plan: the operator does not list the
corpus. A pod whose copy is current goes on to the next collective (loading the weights) and
waits there for the pods still downloading, so once the ranks have agreed on the listing
(they all know its size) the training group's timeout is widened by the modelled download
(`download_timeout`) until the first step sets it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from finetune_operator.api.elastic_timeouts import (
    NODE_STORAGE_BYTES_PER_S,
    CollectiveTimeouts,
    steady_collective_seconds,
)
from finetune_operator.api.jobconfig import JobConfig

log = logging.getLogger(__name__)

# Steps after (re)start that keep the startup timeout: the first compiles and initialises
# lazily (optimizer states, NCCL communicators); the second is the first steady one, measured.
WARMUP_STEPS = 2


def step_timeout(
    timeouts: CollectiveTimeouts, *, steps_run: int, after_save: bool, steady: float
) -> float:
    """The training group's timeout for the next step (pure)."""
    if steps_run < WARMUP_STEPS or after_save:
        return timeouts.startup
    return steady


def total_size(objects: Sequence[HasSize]) -> int:
    return sum(o.size for o in objects)


def download_timeout(startup: float, download_bytes: int) -> float:
    """The training group's timeout while a node may be downloading `download_bytes` that
    its peers wait for (pure): the startup timeout plus the download at the deliberately low
    per-node storage rate the plan's timeouts assume (api/elastic_timeouts.py). Not capped:
    a timeout shorter than the download fails every start (and the corpus is bounded by the
    data cache's size anyway)."""
    return startup + download_bytes / NODE_STORAGE_BYTES_PER_S


class HasSize(Protocol):
    @property
    def size(self) -> int: ...


S = TypeVar("S", bound=HasSize)


class TrainingTimeout:
    """Applies the phase's timeout to the training group, only when it changes."""

    def __init__(
        self, job: JobConfig, timeouts: CollectiveTimeouts, apply: Callable[[float], None]
    ) -> None:
        self.job = job
        self.timeouts = timeouts
        self._apply = apply
        self.steady = timeouts.steady
        self.current = timeouts.startup  # what the group was created with
        self.steps_run = 0
        self.after_save = False

    def _set(self, seconds: float) -> None:
        if seconds != self.current:
            self._apply(seconds)
            self.current = seconds

    def before_step(self) -> None:
        self._set(
            step_timeout(
                self.timeouts,
                steps_run=self.steps_run,
                after_save=self.after_save,
                steady=self.steady,
            )
        )

    def step_done(self, step_seconds: float) -> None:
        self.steps_run += 1
        if self.steps_run == WARMUP_STEPS and not self.timeouts.steady_fixed:
            # The plan's step time is a model: a slower real step widens the timeout.
            self.steady = steady_collective_seconds(self.job.spec, self.job.plan, step_seconds)
        if self.steps_run == WARMUP_STEPS:
            log.info(
                "collective timeout %.0fs from the next step on (startup %.0fs, checkpoint "
                "%.0fs; step %.2fs, planned %.2fs)",
                self.steady,
                self.timeouts.startup,
                self.timeouts.checkpoint,
                step_seconds,
                self.job.plan.estimated_step_seconds,
            )

    def allow_download(self, download_bytes: int) -> None:
        """Before a node may download `download_bytes` that the others wait for; the first
        step's `before_step` sets the startup timeout again."""
        seconds = download_timeout(self.timeouts.startup, download_bytes)
        if seconds > self.current:
            log.info(
                "collective timeout %.0fs while starting: a node may download %d bytes first",
                seconds,
                download_bytes,
            )
            self._set(seconds)

    def agreeing(self, agree: Callable[[list[S]], list[S]]) -> Callable[[list[S]], list[S]]:
        """`agree` (every rank gets rank 0's listing), then the timeout widened for the
        download of what was agreed, on every rank alike."""

        def agreed(objects: list[S]) -> list[S]:
            out = agree(objects)
            self.allow_download(total_size(out))
            return out

        return agreed

    def relax(self) -> None:
        """Before a save, the stop path or the export: back to the startup timeout."""
        self._set(self.timeouts.startup)

    def saved(self, saved: bool) -> None:
        """A save started: its step's skew (rank 0 commits) lasts into the next step."""
        self.after_save = saved
