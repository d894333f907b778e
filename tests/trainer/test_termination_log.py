"""The final report in the termination log: what the operator reads to classify an exit."""

from __future__ import annotations

import json
from pathlib import Path

from finetune_trainer.termination_log import clear_final_report, write_final_report


def test_report_says_resume_skips_and_signal_stop(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.touch()
    assert write_final_report(step=12, loss=1.5, checkpoint_step=12, rank=0, path=str(log),
                              resumed_from_step=5, skipped=[10], stop_reason="Signal")  # fmt: skip
    report = json.loads(log.read_text())
    assert report == {"step": 12, "rank": 0, "loss": 1.5, "checkpointStep": 12,
                      "resumedFromStep": 5, "skippedCheckpoints": [10], "stopReason": "Signal"}  # fmt: skip


def test_a_restarted_trainer_clears_its_predecessors_report(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.touch()
    write_final_report(step=3, loss=None, checkpoint_step=0, rank=0, path=str(log), stop_reason="Signal")
    clear_final_report(str(log))
    assert log.read_text() == ""  # a crash now leaves no stale "stopped by a signal"
    clear_final_report(str(tmp_path / "absent"))  # outside a pod: nothing to do
    assert not (tmp_path / "absent").exists()
