"""The `ftjob run --local` progress display (pure: observations in, lines out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from finetune_local.progress_lines import ProgressTracker, summarize


def _job(step: int | None = None, phase: str = "Running", **status: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"phase": phase, **status}
    if step is not None:
        body["step"] = step
    return {
        "metadata": {"name": "quickstart"},
        "spec": {"training": {"globalBatchSize": 8, "sequenceLength": 128}},
        "status": body,
    }


def test_one_line_per_change_with_rate_between_step_changes() -> None:
    tracker = ProgressTracker(started=0.0)
    assert tracker.observe(_job(10, totalSteps=60), 1.0) is not None
    assert tracker.observe(_job(10, totalSteps=60), 1.5) is None  # nothing changed
    line = tracker.observe(_job(20, totalSteps=60), 2.0)
    assert line is not None and "step 20/60" in line
    assert tracker.tokens_per_second == pytest.approx(10 * 8 * 128 / 1.0)
    # Polls without a new step neither print nor decay the rate.
    assert tracker.observe(_job(20, totalSteps=60), 5.0) is None
    assert tracker.tokens_per_second == pytest.approx(10 * 8 * 128 / 1.0)


def test_step_going_back_restarts_the_rate() -> None:
    tracker = ProgressTracker(started=0.0)
    tracker.observe(_job(30), 1.0)
    tracker.observe(_job(40), 2.0)
    tracker.observe(_job(20), 3.0)  # resumed from the checkpoint at step 20
    tracker.observe(_job(30), 5.0)
    assert tracker.tokens_per_second == pytest.approx(10 * 8 * 128 / 2.0)


def test_render_and_summary_show_checkpoint_restarts_and_conditions() -> None:
    job = _job(
        60,
        phase="Succeeded",
        totalSteps=60,
        loss=2.5,
        restarts=1,
        lastCheckpoint={"step": 60, "uri": "checkpoints/q/step-00000060"},
        conditions=[
            {"type": "Succeeded", "status": "True", "reason": "Completed", "message": "ok"}
        ],
    )
    line = ProgressTracker(started=0.0).observe(job, 3.0)
    assert line is not None
    for part in ("Succeeded", "step 60/60", "loss 2.5000", "checkpoint step 60", "restarts 1"):
        assert part in line
    summary = summarize(job)
    assert summary.startswith("FineTuneJob quickstart: Succeeded")
    assert "Completed: ok" in summary and "steps 60/60" in summary


@pytest.mark.parametrize(
    ("checkpoint", "output", "shown_checkpoint", "shown_output"),
    [
        # Relative URIs resolve in the pods' working directory, not where ftjob was started:
        # "checkpoints/q/..." named a directory the user did not have.
        ("checkpoints/q", "output/q", "/data/run-1/shared/checkpoints/q", "/data/run-1/shared/output/q"),
        ("/mnt/ckpt/q", "s3://bucket/q", "/mnt/ckpt/q", "s3://bucket/q"),
    ],
)  # fmt: skip
def test_summary_says_where_the_checkpoint_and_the_trained_model_are(
    checkpoint: str, output: str, shown_checkpoint: str, shown_output: str
) -> None:
    job = _job(60, phase="Succeeded", lastCheckpoint={"step": 60, "uri": f"{checkpoint}/step-60"})
    job["spec"]["output"] = {"uri": output}
    summary = summarize(job, Path("/data/run-1/shared"))
    assert f"last checkpoint: step 60 at {shown_checkpoint}/step-60" in summary
    assert f"trained model: {shown_output}\n" in summary
    job["status"]["phase"] = "Failed"  # nothing was exported
    assert "trained model" not in summarize(job, Path("/data/run-1/shared"))


def test_a_pod_that_cannot_start_is_shown_while_the_job_waits() -> None:
    waiting = (
        'pod quickstart-worker-0 cannot start: CreateContainerConfigError: secret "s3" not found'
    )
    tracker = ProgressTracker(started=0.0)
    ready = {"type": "WorkersReady", "status": "False", "reason": "WorkersNotReady"}
    starting = _job(phase="Pending", conditions=[{**ready, "message": "0/2 worker pods ready"}])
    line = tracker.observe(starting, 0.5)
    assert line is not None and "waiting" not in line  # pods still starting: nothing to say
    blocked = {
        **ready,
        "message": f"0/2 worker pods ready; {waiting}; pod quickstart-worker-1 cannot start: x",
    }
    line = tracker.observe(_job(phase="Pending", conditions=[blocked]), 2.5)
    assert line is not None and line.endswith(f"restarts 0  waiting: {waiting}")
