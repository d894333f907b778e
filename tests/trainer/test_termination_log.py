"""The final report in the termination log: what the operator reads to classify an exit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from finetune_trainer.termination_log import (
    MAX_BYTES,
    clear_final_report,
    fit_json,
    write_crash_report,
    write_error_report,
    write_final_report,
)

# Adversarial strings: ASCII, 2-byte UTF-8 characters, a quote and a backslash (escaped
# JSON), and astral emoji (a surrogate pair: 12 bytes each as a JSON escape).
LONG_URI = "s3://bucket/" + "a/" * 5000 + "model"
LONG_UNICODE = 'é"\\👩‍🔬' * 2000


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
    write_final_report(
        step=3, loss=None, checkpoint_step=0, rank=0, path=str(log), stop_reason="Signal"
    )
    clear_final_report(str(log))
    assert log.read_text() == ""  # a crash now leaves no stale "stopped by a signal"
    clear_final_report(str(tmp_path / "absent"))  # outside a pod: nothing to do
    assert not (tmp_path / "absent").exists()


def _read(log: Path) -> dict[str, Any]:
    data = log.read_bytes()
    assert len(data) <= MAX_BYTES  # what the kubelet keeps, in bytes
    report = json.loads(data)
    assert isinstance(report, dict)
    return report


@pytest.mark.parametrize(
    "output", [LONG_URI, "s3://b/" + LONG_UNICODE, "x" * 4070], ids=["uri", "unicode", "edge"]
)
def test_final_report_stays_valid_json_whatever_the_output_length(
    tmp_path: Path, output: str
) -> None:
    log = tmp_path / "termination-log"
    log.touch()
    assert write_final_report(step=7, loss=0.5, checkpoint_step=6, rank=2, path=str(log), output=output,
                              skipped=list(range(100)), stop_reason="Signal")  # fmt: skip
    report = _read(log)
    # Only the long string is cut, at its end; every field and number stays.
    assert report["output"].endswith("…") and output.startswith(report["output"][:-1])
    assert len(report["output"]) > 100  # cut to what fits, not emptied
    assert {k: v for k, v in report.items() if k != "output"} == {
        "step": 7, "rank": 2, "loss": 0.5, "checkpointStep": 6,
        "skippedCheckpoints": list(range(32)), "stopReason": "Signal"}  # fmt: skip


def test_error_report_counts_bytes_not_characters(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.touch()
    assert write_error_report("field dataset.uri: " + LONG_UNICODE, rank=1, path=str(log))
    report = _read(log)
    assert report["rank"] == 1 and report["error"].startswith("field dataset.uri: é")


def test_crash_report_beside_a_long_final_report_stays_valid(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.touch()
    write_final_report(step=3, loss=None, checkpoint_step=2, rank=0, path=str(log), output=LONG_URI)
    crash = {"crash": {"rank": 4, "kind": "Exception", "message": "E: " + LONG_UNICODE,
                       "location": "trainer.py:9", "failedRanks": [4]}}  # fmt: skip
    assert write_crash_report(crash, str(log))
    report = _read(log)
    assert report["crash"]["rank"] == 4 and report["crash"]["location"] == "trainer.py:9"


def test_fit_json_shortens_the_longest_strings_first() -> None:
    report = {"a": "x" * 3000, "b": "y" * 3000, "c": "short", "n": [1, 2], "d": {"e": "é" * 900}}
    text = fit_json(report, limit=2000)
    fitted = json.loads(text)
    assert len(text.encode()) <= 2000
    assert fitted["c"] == "short" and fitted["n"] == [1, 2]  # the short ones untouched
    assert fitted["d"]["e"].endswith("…") and fitted["a"].endswith("…")
    assert fit_json({"a": "x"}, limit=2000) == json.dumps({"a": "x"})  # within the limit: as is
