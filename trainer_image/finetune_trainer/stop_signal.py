"""A SIGTERM or SIGINT (a pod deleted, drained or preempted; Ctrl-C) asks the trainer to stop:
the handler only records it, and the loop finishes the step, agrees with its peers and saves
a final checkpoint (finish.finish_run)."""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

log = logging.getLogger(__name__)


class StopSignal:
    """SIGTERM/SIGINT only set a flag; the loop finishes the step and stops collectively."""

    def __init__(self) -> None:
        self.received_at: float | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
            log.warning("received signal %d: stopping after this step", signum)

    @property
    def requested(self) -> bool:
        return self.received_at is not None
