"""How long a DDP rank waited for its gradient all-reduce, with the reduction overlapped.

DDP all-reduces each gradient bucket as soon as backward has filled it, overlapping the
communication with the rest of backward. A rank's own work ends when it hands its *last* bucket
to the all-reduce; from then until backward returns it only waits (for the wire, and for slower
peers to produce their buckets). The clock marks both moments:

- `bucket_ready()`, from DDP's communication hook, each time a bucket is handed over (the last
  call of a step is the one that counts);
- `backward_done()`, after the step's last backward has returned, when DDP has made the
  computation wait for every bucket's reduction.

`wait_seconds()` is the time between the two. On CUDA both marks are events on the compute
stream, so the figure is the device's own timeline (the reduction runs on NCCL's stream, beside
the compute); on CPU (gloo) they are host clock readings, since the autograd thread itself
blocks in DDP's finalisation. Read it after the device is synchronised.
"""

from __future__ import annotations

import time

import torch


class ReductionClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._ready: torch.cuda.Event | float | None = None
        self._done: torch.cuda.Event | float | None = None

    def _mark(self) -> torch.cuda.Event | float:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        """Forget the previous step's marks (at the start of the step's last micro-batch)."""
        self._ready = self._done = None

    def bucket_ready(self) -> None:
        self._ready = self._mark()

    def backward_done(self) -> None:
        self._done = self._mark()

    def wait_seconds(self) -> float:
        """Seconds between the last bucket handed to the all-reduce and the end of backward;
        0 when this step reduced nothing."""
        ready, done = self._ready, self._done
        if ready is None or done is None:
            return 0.0
        if isinstance(ready, torch.cuda.Event) and isinstance(done, torch.cuda.Event):
            return max(0.0, ready.elapsed_time(done) / 1000.0)
        assert isinstance(ready, float) and isinstance(done, float)
        return max(0.0, done - ready)
