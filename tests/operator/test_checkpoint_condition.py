"""A failed checkpoint save, from the trainer's metrics page (or final report) to the job's
`CheckpointFailing` condition, through the operator's pure functions."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
import torch
from prometheus_client import generate_latest

from finetune_operator.api.constants import COND_CHECKPOINT_FAILING
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import (
    TrainerProgress,
    combine_progress,
    merge_progress,
    note_checkpoint_health,
    parse_termination_message,
    parse_trainer_metrics,
)
from finetune_operator.reconcile.conditions import find
from finetune_trainer.metrics import TrainerMetrics

NOW = datetime(2026, 11, 23, 3, 0, tzinfo=UTC)
LATER = datetime(2026, 11, 23, 3, 5, tzinfo=UTC)


def page(*, committed: list[int], failed: list[int]) -> str:
    """The metrics page of a real TrainerMetrics after these commits and failures."""
    m = TrainerMetrics(job="qs", rank=0, device=torch.device("cpu"), reforms=0, total_steps=100)
    for step in sorted([*committed, *failed]):
        if step in failed:
            m.observe_checkpoint_failed(step)
        else:
            m.observe_checkpoint_committed(step, 1.0)
    return generate_latest(m.registry).decode()


def status_after(
    text: str, status: FineTuneJobStatus | None = None, now: datetime = NOW
) -> FineTuneJobStatus:
    progress = combine_progress([parse_trainer_metrics(text)])
    merged = merge_progress(status or FineTuneJobStatus(), progress, "ckpt")
    return note_checkpoint_health(merged, progress, now, generation=3)


@pytest.mark.parametrize(
    ("committed", "failed", "expected", "in_message"),
    [
        ([10, 20], [], "False", "newest committed checkpoint: step 20"),
        ([10], [20], "True", "checkpoint save at step 20 failed, 1 failed saves so far"),
        ([10, 30], [20], "False", "step 30"),  # a later save committed: recovered
        ([], [10, 20], "True", "2 failed saves so far; newest committed checkpoint: none"),
    ],
    ids=["healthy", "newest-failed", "recovered", "never-committed"],
)
def test_condition_from_the_scraped_page(
    committed: list[int], failed: list[int], expected: str, in_message: str
) -> None:
    cond = find(
        status_after(page(committed=committed, failed=failed)).conditions, COND_CHECKPOINT_FAILING
    )
    assert cond is not None and cond.status == expected
    assert in_message in cond.message
    assert cond.observed_generation == 3


def test_transition_time_moves_only_on_a_change_and_silence_keeps_it() -> None:
    failing = status_after(page(committed=[10], failed=[20]))
    again = status_after(page(committed=[10], failed=[20, 30]), failing, LATER)
    cond = find(again.conditions, COND_CHECKPOINT_FAILING)
    assert cond is not None and cond.status == "True" and "step 30" in cond.message
    assert (
        cond.last_transition_time
        == find(failing.conditions, COND_CHECKPOINT_FAILING).last_transition_time
    )
    # A pass where no trainer answered (between restarts): the condition stays as it was.
    quiet = note_checkpoint_health(again, TrainerProgress(), LATER, generation=3)
    assert find(quiet.conditions, COND_CHECKPOINT_FAILING) == cond
    healed = status_after(page(committed=[10, 40], failed=[20, 30]), again, LATER)
    assert find(healed.conditions, COND_CHECKPOINT_FAILING).status == "False"


def test_final_report_of_a_failed_final_save_sets_the_condition() -> None:
    report = json.dumps({"step": 100, "rank": 0, "checkpointStep": 90, "checkpointFailedStep": 100})
    progress = combine_progress([parse_termination_message(report)])
    assert progress.checkpoint_failed_step == 100
    merged = merge_progress(FineTuneJobStatus(), progress, "ckpt")
    cond = find(
        note_checkpoint_health(merged, progress, NOW, 1).conditions, COND_CHECKPOINT_FAILING
    )
    assert cond is not None and cond.status == "True" and "step 100" in cond.message


def test_final_report_of_a_committed_final_save_updates_the_newest_step() -> None:
    """The last scrape saw step 50; the workers' final reports say the final save committed
    step 60: the condition must not go on naming 50 beside `lastCheckpoint` 60."""
    running = status_after(page(committed=[40, 50], failed=[]))
    report = json.dumps({"step": 60, "rank": 0, "checkpointStep": 60, "loss": 2.5})
    progress = combine_progress([parse_termination_message(report)])
    merged = merge_progress(running, progress, "ckpt")
    done = note_checkpoint_health(merged, progress, LATER, 3)
    cond = find(done.conditions, COND_CHECKPOINT_FAILING)
    assert done.last_checkpoint is not None and done.last_checkpoint.step == 60
    assert cond is not None and cond.status == "False"
    assert cond.message == "newest committed checkpoint: step 60"
