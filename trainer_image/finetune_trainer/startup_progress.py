"""What a rank's start-up work has done so far: the start-up barrier's measure of progress.

The barrier (startup_barrier.py) publishes, every heartbeat, this rank's phase and a progress
count; its peers wait for a rank whose count keeps moving, however slowly, and fail on one
whose count has stood still for the phase's stall limit (alive, beating, but stuck: a hung
download socket, a deadlocked tokenizer worker, an NFS mount that blocks). The count is what
the work does, not a clock: records tokenized (`advance`, from data/blocks.py), another pod's
build advancing (data/build_claim.py), and a phase's `probe`: the bytes under the directory a
download or a copy writes into, read by the beat thread, so that partial files count and a
local rank waiting on a sibling's lock (the sibling downloading or building into the same
directory) sees the sibling's progress as its own.

One object per process (`PROGRESS`): the data modules report into it without knowing about
the barrier. No torch here: the data modules import it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

Probe = Callable[[], int]


@dataclass(frozen=True)
class Sample:
    """This rank's phase, its progress count, and how much longer than the startup timeout
    the phase may go without progress (`extra_s`; `stall_limit`)."""

    phase: str
    progress: int
    extra_s: float = 0.0


def stall_limit(startup_s: float, extra_s: float = 0.0) -> float:
    """Pure: how long a rank's progress may stand still before it counts as stuck: the
    startup collective timeout (a rank that does nothing for that long is treated as a
    collective would treat a rank that does not answer for that long), plus what its phase
    justifies (`extra_s`: work whose progress shows only in large steps)."""
    return startup_s + extra_s


def directory_bytes(root: Path) -> int:
    """The bytes of the files under `root` (0 if it is not there): a download's or a copy's
    progress, partial files included. Files vanishing during the walk (a temporary file
    renamed, a stale copy removed) are skipped."""
    total = 0
    for parent, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(parent, name), follow_symlinks=False).st_size
    return total


class StartupProgress:
    """The current phase (a name, an optional probe, its extra stall allowance) and a count
    that work adds to. The count only grows; a phase's probe is added to it when sampled."""

    def __init__(self) -> None:
        self._count = 0
        self._phase: tuple[str, Probe | None, float] = ("starting", None, 0.0)
        self._lock = threading.Lock()
        self._probed = 0
        self._echo: Path | None = None
        self._probe_failed = False

    def advance(self, amount: int = 1) -> None:
        """Work was done (records tokenized, another pod's build advanced)."""
        with self._lock:
            self._count += amount
        if self._echo is not None:
            with contextlib.suppress(OSError), open(self._echo, "ab") as f:
                f.write(b".")

    @contextlib.contextmanager
    def echoed(self, path: Path) -> Iterator[None]:
        """Inside, each `advance` also appends a byte to `path` (removed after): the local
        ranks waiting on a lock this rank holds count its growth (their phase's directory
        probe) as their own progress, though the work is another pod's build this rank
        waits for."""
        self._echo = path
        try:
            yield
        finally:
            self._echo = None
            with contextlib.suppress(OSError):
                path.unlink()

    @contextlib.contextmanager
    def phase(self, name: str, probe: Probe | None = None, extra_s: float = 0.0) -> Iterator[None]:
        """The work inside is `name` (what the peers' error names); `probe`: a further
        measure of its progress, read every heartbeat; `extra_s`: see `stall_limit`."""
        previous = self._phase
        self._phase = (name, probe, extra_s)
        try:
            yield
        finally:
            self._phase = previous

    def sample(self) -> Sample:
        """Now (called from the beat thread). A probe that fails reads as its last value:
        no progress, never an error in the beat thread. Whatever it raises: an exception
        escaping here would end the beat thread, and the peers would read a rank that is
        working as a lost one (and it would no longer judge itself stuck)."""
        name, probe, extra_s = self._phase
        if probe is not None:
            try:
                self._probed = probe()
            except OSError:
                pass  # the directory went away, a file vanished: no progress this time
            except Exception as e:  # a probe's own bug (an import, a renamed helper)
                if not self._probe_failed:
                    log.warning("start-up progress probe of phase %r failed (%r): its "
                                "progress reads as its last value", name, e)  # fmt: skip
                    self._probe_failed = True
        else:
            self._probed = 0
        return Sample(name, self._count + self._probed, extra_s)


PROGRESS = StartupProgress()


def advance(amount: int = 1) -> None:
    PROGRESS.advance(amount)


def phase(
    name: str, probe: Probe | None = None, extra_s: float = 0.0
) -> contextlib.AbstractContextManager[None]:
    return PROGRESS.phase(name, probe, extra_s)
