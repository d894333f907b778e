"""Async saves under real torchrun (2 ranks, gloo, the trainer's own staging): every save of a
run commits; a failed save is logged with its traceback on every rank and training goes on; a
failed final save is never a clean finish; a resume from a staged checkpoint continues the
loss. Marked slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune_operator.api.constants import CHECKPOINT_COMMITTED_MARKER
from tests.trainer.conftest import (
    Proc,
    launch_standalone,
    make_job,
    step_lines,
    tail,
)
from tests.trainer.conftest import write_job as write_job_file

pytestmark = pytest.mark.slow


def committed(root: Path) -> set[int]:
    return {
        int(json.loads(m.read_text())["step"])
        for m in root.glob(f"step-*/{CHECKPOINT_COMMITTED_MARKER}")
    }


def test_saves_commit_failures_are_visible_and_a_failed_final_save_is_no_clean_finish(
    tmp_path: Path, procs: list[Proc]
) -> None:
    root = tmp_path / "checkpoints" / "quickstart"

    def launch(name: str, max_steps: int, **env: str) -> Proc:
        job = make_job(
            training={"maxSteps": max_steps}, checkpoint={"intervalSteps": 2, "keep": 10}
        )
        path = write_job_file(tmp_path / f"{name}.json", job)
        return launch_standalone(
            path, cwd=tmp_path, log=tmp_path / f"{name}.log", procs=procs, **env
        )

    p = launch("clean", 8)
    assert p.wait(150) == 0, tail(p.log)
    assert committed(root) == {2, 4, 6, 8}  # every async save of the run
    loss8 = step_lines(p.log)[-1]["loss"]

    # Next run: the save at step 10 and the final one at 14 cannot be written (a file sits
    # where their directory must go); 12 can.
    for step in (10, 14):
        (root / f"step-{step:08d}").write_text("not a directory")
    report = tmp_path / "termination-log"
    report.write_text("")
    q = launch("failing", 14, FT_TERMINATION_LOG=str(report))
    assert q.wait(150) != 0, tail(q.log)
    log = q.log.read_text(errors="replace")
    assert "resumed from checkpoint step 8" in log
    first = step_lines(q.log)[0]
    assert first["step"] == 9 and abs(first["loss"] - loss8) < 0.4, (first, loss8)
    assert committed(root) == {2, 4, 6, 8, 12}  # training went on past the failed save
    assert log.count("checkpoint step 10 NOT committed") == 2, tail(q.log)  # both ranks
    assert "checkpoint step 10: write failed" in log and "Traceback" in log
    assert "final checkpoint (step 14) failed" in log
    assert "training complete" not in log
    assert "exitcode  : 3" in log  # torchrun's summary of the worker's exit code
    final = json.loads(report.read_text())
    assert final["checkpointStep"] == 12 and final["checkpointFailedStep"] == 14
    assert "output" not in final  # nothing exported from an uncheckpointed end
