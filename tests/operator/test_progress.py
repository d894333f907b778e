"""Trainer metrics text → progress → status."""

from __future__ import annotations

import pytest

from finetune_operator.api.status import CheckpointRef, FineTuneJobStatus
from finetune_operator.reconcile import (
    TrainerProgress,
    combine_progress,
    merge_progress,
    observe_pod,
    parse_trainer_metrics,
    scrape_targets,
)

RANK0 = """\
# HELP finetune_trainer_step Last optimizer step.
# TYPE finetune_trainer_step gauge
finetune_trainer_step{finetunejob="qs",rank="0"} 42.0
# HELP finetune_trainer_loss Loss of the last step.
# TYPE finetune_trainer_loss gauge
finetune_trainer_loss{finetunejob="qs",rank="0"} 2.5
# TYPE finetune_trainer_last_checkpoint_step gauge
finetune_trainer_last_checkpoint_step{finetunejob="qs",rank="0"} 40.0
# TYPE finetune_trainer_last_checkpoint_timestamp_seconds gauge
finetune_trainer_last_checkpoint_timestamp_seconds{finetunejob="qs",rank="0"} 1.7672256e+09
# TYPE finetune_trainer_tokens_total counter
finetune_trainer_tokens_total{finetunejob="qs",rank="0"} 1000.0
# TYPE finetune_trainer_step_duration_seconds histogram
finetune_trainer_step_duration_seconds_bucket{finetunejob="qs",rank="0",le="+Inf"} 42.0
finetune_trainer_step_duration_seconds_count{finetunejob="qs",rank="0"} 42.0
finetune_trainer_step_duration_seconds_sum{finetunejob="qs",rank="0"} 21.0
"""
RANK1 = """\
# TYPE finetune_trainer_step gauge
finetune_trainer_step{finetunejob="qs",rank="1"} 43.0
# TYPE finetune_trainer_loss gauge
finetune_trainer_loss{finetunejob="qs",rank="1"} 9.9
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (RANK0, TrainerProgress(42, 2.5, 0, 40, 1.7672256e09)),
        (RANK1, TrainerProgress(43, 9.9, 1, None, None)),
        ("", TrainerProgress()),
        ("this is { not prometheus", TrainerProgress()),
        (
            "# TYPE finetune_trainer_last_checkpoint_step gauge\n"
            'finetune_trainer_last_checkpoint_step{rank="0"} -1\n',
            TrainerProgress(),
        ),
        (
            # A trainer before its first step (fresh, or resumed at 40): its loss gauge reads
            # its initial 0, no loss; the step is where it starts.
            '# TYPE finetune_trainer_step gauge\nfinetune_trainer_step{rank="0"} 40\n'
            '# TYPE finetune_trainer_loss gauge\nfinetune_trainer_loss{rank="0"} 0\n'
            "# TYPE finetune_trainer_tokens_total counter\n"
            'finetune_trainer_tokens_total{rank="0"} 0\n',
            TrainerProgress(step=40),
        ),
    ],
    ids=["rank0", "rank1", "empty", "garbage", "no-checkpoint-yet", "no-step-yet"],
)
def test_parse(text: str, expected: TrainerProgress) -> None:
    assert parse_trainer_metrics(text) == expected


def test_combine_takes_furthest_step_and_lowest_rank_loss() -> None:
    parts = [parse_trainer_metrics(RANK1), parse_trainer_metrics(RANK0), TrainerProgress()]
    assert combine_progress(parts) == TrainerProgress(43, 2.5, 0, 40, 1.7672256e09)
    assert combine_progress([]) == TrainerProgress()


def test_merge_into_status() -> None:
    status = FineTuneJobStatus(step=10, loss=3.0, total_steps=60)
    merged = merge_progress(
        status, combine_progress([parse_trainer_metrics(RANK0)]), "checkpoints/qs/"
    )
    assert (merged.step, merged.loss, merged.total_steps) == (42, 2.5, 60)
    assert merged.last_checkpoint == CheckpointRef(
        step=40, uri="checkpoints/qs/step-00000040", time="2026-01-01T00:00:00Z"
    )
    # Nothing scraped (all endpoints down): status keeps what it had, the same object.
    assert merge_progress(merged, TrainerProgress(), "checkpoints/qs") is merged


def test_scrape_targets_cover_every_local_rank_of_running_workers() -> None:
    def pod(name: str, role: str, phase: str, ip: str | None) -> dict[str, object]:
        labels = {"finetune.dev/job": "qs", "finetune.dev/role": role}
        if role == "worker":
            labels["finetune.dev/worker-index"] = name[-1]
        return {
            "metadata": {"name": name, "labels": labels},
            "status": {"phase": phase, "podIP": ip},
        }

    pods = [
        observe_pod(pod("qs-worker-0", "worker", "Running", "10.0.0.5")),
        observe_pod(pod("qs-worker-1", "worker", "Pending", None)),
        observe_pod(pod("qs-rdzv", "rendezvous", "Running", "10.0.0.9")),
    ]
    assert [t.url for t in scrape_targets(pods, 2)] == [
        "http://10.0.0.5:9400/metrics",
        "http://10.0.0.5:9401/metrics",
    ]


@pytest.mark.parametrize(
    ("text", "step", "checkpoint", "loss"),
    [
        ('{"step": 60, "loss": 2.5, "checkpointStep": 60, "checkpointTime": 1.0}', 60, 60, 2.5),
        ('{"step": 12}', 12, None, None),
        ('{"step": 12, "checkpointStep": 0}', 12, None, None),
        ("Traceback (most recent call last):\n  boom", None, None, None),
        ('["not", "a", "report"]', None, None, None),
        ('{"step": "x", "loss": NaN}', None, None, None),
        ("", None, None, None),
    ],
    ids=["full", "step-only", "no-checkpoint-yet", "log-tail", "not-an-object", "junk", "empty"],
)
def test_parse_termination_message(
    text: str, step: int | None, checkpoint: int | None, loss: float | None
) -> None:
    from finetune_operator.reconcile.progress import parse_termination_message

    report = parse_termination_message(text)
    assert (report.step, report.checkpoint_step, report.loss) == (step, checkpoint, loss)


RESUMED_PAGE = """\
# TYPE finetune_trainer_step gauge
finetune_trainer_step{finetunejob="qs",rank="0"} 23.0
# TYPE finetune_trainer_resumed_from_step gauge
finetune_trainer_resumed_from_step{finetunejob="qs",rank="0"} 20.0
# TYPE finetune_trainer_skipped_checkpoint_step gauge
finetune_trainer_skipped_checkpoint_step{finetunejob="qs",rank="0"} 30.0
"""


def test_resume_and_skipped_checkpoint_reach_status_with_one_event() -> None:
    from finetune_operator.reconcile import progress_events

    progress = parse_trainer_metrics(RESUMED_PAGE)
    assert (progress.resumed_from_step, progress.skipped_checkpoint) == (20, 30)
    old = FineTuneJobStatus()
    new = merge_progress(old, progress, "checkpoints/qs")
    assert new.resumed_from_step == 20 and new.skipped_checkpoints == [30]
    events = progress_events(old, new)
    assert [(e.type, e.reason) for e in events] == [("Warning", "CheckpointSkipped")]
    assert "step 30" in events[0].message and "step 20" in events[0].message
    again = merge_progress(new, progress, "checkpoints/qs")
    assert again == new and progress_events(new, again) == []


@pytest.mark.parametrize(
    ("report", "resumed", "skipped"),
    [
        pytest.param(
            '{"step": 9, "rank": 0, "resumedFromStep": 5, "skippedCheckpoints": [8, 7]}',
            5,
            8,
            id="resumed",
        ),
        pytest.param('{"step": 9, "rank": 0}', 0, None, id="fresh"),
        pytest.param('{"step": 9, "skippedCheckpoints": "x"}', 0, None, id="garbled-list"),
        pytest.param("Traceback ...", None, None, id="log-tail"),
    ],
)
def test_final_report_resume_fields(report: str, resumed: int | None, skipped: int | None) -> None:
    from finetune_operator.reconcile import parse_termination_message

    p = parse_termination_message(report)
    assert (p.resumed_from_step, p.skipped_checkpoint) == (resumed, skipped)


def test_an_epochs_job_gets_its_total_steps_from_the_trainers() -> None:
    """With `epochs` and no `maxSteps` only the trainer knows the step count (from the data):
    status.totalSteps stayed unset and `ftjob run --local` said "step 198/?" to the end."""
    page = RANK0 + (
        "# TYPE finetune_trainer_total_steps gauge\n"
        'finetune_trainer_total_steps{finetunejob="qs",rank="0"} 198.0\n'
    )
    progress = combine_progress([parse_trainer_metrics(page), parse_trainer_metrics(RANK1)])
    assert progress.total_steps == 198
    status = merge_progress(FineTuneJobStatus(), progress, "checkpoints/qs")
    assert (status.step, status.total_steps) == (43, 198)
    # maxSteps, written from the spec, is never replaced by a scrape.
    pinned = merge_progress(FineTuneJobStatus(total_steps=60), progress, "checkpoints/qs")
    assert pinned.total_steps == 60
