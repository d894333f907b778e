"""The checkpoint stall estimator (pure): save-call time plus the excess of the steps that ran
while the save was in flight over the median save-free step."""

from __future__ import annotations

import pytest

from finetune_trainer.stall import StallEstimator


def run(steps: list[tuple[float, str]]) -> list[tuple[int, float, float, int]]:
    """steps: (seconds, event) with event '' (plain step), 'save:<call>' (a save after this
    step), 'done' (the write finished during this step). Returns (step, blocking, stall, n)."""
    est, out, in_flight = StallEstimator(), [], False
    for n, (seconds, event) in enumerate(steps, 1):
        done = event == "done"
        closed = est.step(seconds, write_done=done or not in_flight)
        in_flight = in_flight and not done
        out += [closed] if closed else []
        if event.startswith("save:"):
            out += est.save(n, float(event[5:]), write_done=False)
            in_flight = True
        if event.startswith("wait:"):
            est.staging_wait(float(event[5:]))
    out += [s for s in (est.close(),) if s]
    return [(s.step, round(s.blocking, 6), round(s.stall, 6), s.steps) for s in out]


WARM = [(5.0, ""), (1.0, ""), (1.0, ""), (1.0, "")]  # the first step is warm-up, not baseline


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        # The two steps after the save run 0.5 s and 0.25 s slower; the write ends in the 2nd.
        ([*WARM, (1.0, "save:0.01"), (1.5, ""), (1.25, "done"), (1.0, "")], [(5, 0.01, 0.76, 2)]),
        # Noise below the baseline is subtracted, not ignored (signed sum).
        ([*WARM, (1.0, "save:0.01"), (1.3, ""), (0.9, "done")], [(5, 0.01, 0.21, 2)]),
        # Faster than usual throughout: never below the save-call time.
        ([*WARM, (1.0, "save:0.02"), (0.8, "done")], [(5, 0.02, 0.02, 1)]),
        # No baseline yet (too few clean steps): blocking only, a lower bound.
        ([(5.0, ""), (1.0, "save:0.03"), (3.0, "done")], [(2, 0.03, 0.03, 1)]),
        # A write still in flight at the end of the run is reported when closed.
        ([*WARM, (1.0, "save:0.01"), (2.0, "")], [(5, 0.01, 1.01, 1)]),
    ],
    ids=["excess-counted", "signed-noise", "floor", "no-baseline", "closed-at-end"],
)
def test_stall(
    steps: list[tuple[float, str]], expected: list[tuple[int, float, float, int]]
) -> None:
    assert run(steps) == expected


def test_staging_wait_is_blocking_but_counted_once_in_the_stall() -> None:
    est = StallEstimator()
    for s in (5.0, 1.0, 1.0, 1.0):
        est.step(s, write_done=True)
    assert est.save(4, 0.01, write_done=False) == []
    est.staging_wait(0.2)  # inside the next step, which is 0.2 s slower for it
    stall = est.step(1.2, write_done=True)
    assert stall is not None and stall.blocking == pytest.approx(0.21)
    assert stall.stall == pytest.approx(0.21) and stall.wait == pytest.approx(0.2)


def test_window_is_capped_and_steps_in_it_are_not_baseline() -> None:
    est = StallEstimator(max_window_steps=3)
    for s in (5.0, 1.0, 1.0, 1.0):
        est.step(s, write_done=True)
    est.save(4, 0.0, write_done=False)
    assert est.step(9.0, write_done=False) is None
    assert est.step(9.0, write_done=False) is None
    stall = est.step(9.0, write_done=False)
    assert stall is not None and stall.steps == 3 and stall.stall == pytest.approx(24.0)
    assert est.baseline() == pytest.approx(1.0)  # the slow window steps did not enter it


def test_a_synchronous_save_closes_at_once() -> None:
    est = StallEstimator()
    [stall] = est.save(3, 2.5, write_done=True)
    assert (stall.step, stall.blocking, stall.stall, stall.steps) == (3, 2.5, 2.5, 0)
