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

Work a rank does alone while starting (a pod's download of an `s3://` corpus, its data cache's
build, a hub snapshot) is not waited for in a collective, so it never widens this timeout:
the ranks meet after it at the start-up barrier, through the store (startup_barrier.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from finetune_operator.api.elastic_timeouts import CollectiveTimeouts, steady_collective_seconds
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

    def relax(self) -> None:
        """Before a save, the stop path or the export: back to the startup timeout."""
        self._set(self.timeouts.startup)

    def saved(self, saved: bool) -> None:
        """A save started: its step's skew (rank 0 commits) lasts into the next step."""
        self.after_save = saved
