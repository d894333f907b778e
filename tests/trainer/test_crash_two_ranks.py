"""A rank that raises mid-training, under real torchrun (2 ranks, gloo, CPU) behind the
trainer's launcher: the container's termination log names the exception, the rank, where it
was raised and what the plan predicted; the pod's log keeps torchrun's summary. Marked slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune_operator.api.plan import MemoryBreakdown
from tests.trainer.conftest import Proc, launch_standalone, make_job, tail, write_job

pytestmark = pytest.mark.slow
GIB = 2**30


def test_a_rank_that_raises_is_named_in_the_termination_log(
    tmp_path: Path, procs: list[Proc]
) -> None:
    job = make_job(training={"maxSteps": 6})
    memory = MemoryBreakdown(parameters=GIB, gradients=GIB, optimizer=2 * GIB, activations=GIB,
                             buffers=0, peak=5 * GIB, reserved=6 * GIB, total=7 * GIB)  # fmt: skip
    job = job.model_copy(update={"plan": job.plan.model_copy(update={"memory": memory})})
    report = tmp_path / "termination-log"
    report.write_text("")
    p = launch_standalone(
        write_job(tmp_path / "job.json", job), cwd=tmp_path, log=tmp_path / "t.log", procs=procs,
        FT_TERMINATION_LOG=str(report), FT_CRASH_AT_STEP="3", FT_CRASH_RANK="1",
        FT_CRASH_KIND="oom",
    )  # fmt: skip
    assert p.wait(150) == 1, tail(p.log)
    crash = json.loads(report.read_text())["crash"]
    assert crash["rank"] == 1, crash  # not rank 0, which only lost its peer
    assert crash["kind"] == "OutOfMemory" and crash["exception"] == "torch.OutOfMemoryError"
    assert "injected at step 3" in crash["message"], crash
    assert crash["planned"] == "planned 7.0 GiB per GPU of 2.0 GiB", crash
    assert crash["location"].startswith("faults.py:"), crash
    assert "self._crash(step)" in crash["traceback"], crash  # the caller's line, kept
    log = p.log.read_text(errors="replace")
    assert "Root Cause (first observed failure)" in log  # torchrun's own summary, kept
    assert "crash report: rank 1: OutOfMemoryError" in log
