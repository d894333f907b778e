"""The fault-injection component: a no-op unless configured; a slow rank sleeps in its compute;
a hang happens once per marker file (a transient fault a restart recovers from)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from finetune_trainer.faults import FaultConfig, InjectedFaults, NoFaults, build_faults


def test_disabled_is_a_no_op_object() -> None:
    assert isinstance(build_faults(FaultConfig.from_environ({})), NoFaults)


@pytest.mark.parametrize(
    ("env", "field"),
    [({"FT_STEP_DELAY_SECONDS": "x"}, "FT_STEP_DELAY_SECONDS"),
     ({"FT_STEP_DELAY_SECONDS": "-1"}, "FT_STEP_DELAY_SECONDS"),
     ({"FT_HANG_AT_STEP": "1.5"}, "FT_HANG_AT_STEP")],
)  # fmt: skip
def test_bad_knob_named(env: dict[str, str], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        FaultConfig.from_environ(env)


def test_delay_is_spread_over_micro_batches() -> None:
    faults = build_faults(FaultConfig.from_environ({"FT_STEP_DELAY_SECONDS": "0.2"}))
    start = time.perf_counter()
    for _ in range(4):
        faults.after_micro_batch(1, 4)
    assert 0.19 <= time.perf_counter() - start < 1.0


def test_hang_once_per_marker(tmp_path: Path) -> None:
    marker = tmp_path / "hang"
    env = {"FT_HANG_AT_STEP": "3", "FT_HANG_MARKER": str(marker)}
    first = InjectedFaults(FaultConfig.from_environ(env))
    first.after_micro_batch(2, 1)  # not the step: returns
    hung = threading.Thread(target=first.after_micro_batch, args=(3, 1), daemon=True)
    hung.start()
    hung.join(0.5)
    assert hung.is_alive() and marker.exists()  # stuck, as a hung kernel would be
    # The restarted rank finds the marker and goes on.
    InjectedFaults(FaultConfig.from_environ(env)).after_micro_batch(3, 1)
