"""What a checkpoint save really costs the training loop (pure: step times in, estimates out).

The time the loop is blocked inside the save call and waiting for staging (`blocking`)
under-reports the cost of an async save: while the background copy and write run they compete
with training for cores, memory bandwidth and PCIe, and the steps after a save run slower
(measured on CPU: 8.7 ms blocking per save, ~87 ms really lost). The estimator:

    stall = save-call time + sum over the save's window of (step time - baseline)

where the window is the steps that run while the save is in flight (from the save to the
step during which its write completed, at most `max_window_steps`), and the baseline is the
median wall time of the last `baseline_steps` steps that ran with no save in flight (the
first `warmup_steps` of a run excluded: compilation, allocator warm-up). The staging wait the
loop does before the optimizer step falls inside a window step, so it is counted once, as
part of that step's excess. The excess is summed signed (noise cancels instead of
accumulating) and the total is never below the save-call time. With fewer than
`min_baseline` clean steps seen, the stall is the save-call plus staging-wait time alone.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Stall:
    """One save's cost. `blocking`: save call + staging wait (`wait`); `stall`: save call +
    excess step time over the window; `steps`: steps in the window."""

    step: int
    blocking: float
    stall: float
    steps: int
    wait: float = 0.0


@dataclass
class _Window:
    step: int
    call: float
    wait: float = 0.0
    excess: float = 0.0
    steps: int = 0


@dataclass
class StallEstimator:
    baseline_steps: int = 20
    max_window_steps: int = 32
    min_baseline: int = 3
    warmup_steps: int = 1
    _clean: deque[float] = field(default_factory=deque)
    _seen: int = 0
    _window: _Window | None = None

    def baseline(self) -> float | None:
        if len(self._clean) < self.min_baseline:
            return None
        return statistics.median(self._clean)

    def save(self, step: int, call_seconds: float, *, write_done: bool) -> list[Stall]:
        """A save of `step` returned after `call_seconds`. Returns the stalls this closes: a
        window still open from an earlier save, and this one's if its write is already done
        (a synchronous save: nothing left to slow the next steps)."""
        closed = [s for s in (self.close(),) if s is not None]
        self._window = _Window(step, call_seconds)
        if write_done:
            closed += [s for s in (self.close(),) if s is not None]
        return closed

    def staging_wait(self, seconds: float) -> None:
        if self._window is not None:
            self._window.wait += seconds

    def step(self, seconds: float, *, write_done: bool) -> Stall | None:
        """A training step took `seconds`; `write_done`: the save in flight (if any) has
        finished writing (committed or failed) by the end of this step."""
        self._seen += 1
        w = self._window
        if w is None:
            if self._seen > self.warmup_steps:
                self._clean.append(seconds)
                while len(self._clean) > self.baseline_steps:
                    self._clean.popleft()
            return None
        base = self.baseline()
        w.steps += 1
        if base is not None:
            w.excess += seconds - base
        if write_done or w.steps >= self.max_window_steps:
            return self.close()
        return None

    def close(self) -> Stall | None:
        """Close the open window (end of run, or the write finished between steps)."""
        w, self._window = self._window, None
        if w is None:
            return None
        # Without a baseline the excess is unknown: report what was measured directly.
        stall = w.call + w.wait if self.baseline() is None else w.call + max(0.0, w.excess)
        return Stall(w.step, blocking=w.call + w.wait, stall=stall, steps=w.steps, wait=w.wait)
