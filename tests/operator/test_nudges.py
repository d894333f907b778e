"""The nudges a Workload event leaves for its job's timer (handlers.workloads): taken once,
and never kept for a job that is gone."""

from __future__ import annotations

from typing import Any

from finetune_operator.handlers.workloads import (
    NUDGE_TTL_SECONDS,
    forget_nudge,
    nudge,
    take_nudge,
)

JOB, OTHER = ("ns", "a"), ("ns", "b")


def test_a_nudge_is_taken_once() -> None:
    memo: dict[str, Any] = {}
    nudge(memo, JOB, 0.0)
    assert take_nudge(memo, JOB) and not take_nudge(memo, JOB)
    assert not take_nudge(memo, OTHER)


def test_a_deleted_job_s_nudge_is_forgotten() -> None:
    memo: dict[str, Any] = {}
    nudge(memo, JOB, 0.0)
    forget_nudge(memo, JOB)
    forget_nudge(memo, JOB)  # twice: no error
    assert memo["nudged"] == {}


def test_a_nudge_left_after_its_job_s_delete_handler_does_not_stay_for_good() -> None:
    """A Workload event can arrive after the job's delete handler forgot it (the finalizer
    that handler removed, say): its nudge is dropped once no timer took it in time."""
    memo: dict[str, Any] = {}
    nudge(memo, JOB, 0.0)  # the job is gone: no timer takes it
    nudge(memo, OTHER, NUDGE_TTL_SECONDS / 2)
    nudge(memo, OTHER, NUDGE_TTL_SECONDS + 1)
    assert set(memo["nudged"]) == {OTHER}
