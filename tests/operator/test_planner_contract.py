"""The real planner behind `default_planner()` plans the shipped quickstart."""

from __future__ import annotations

from datetime import UTC, datetime

from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import JobRef, default_planner, reconcile_job
from tests.operator.factories import UID, quickstart_raw


def test_quickstart_plans_and_creates_its_objects() -> None:
    job = JobRef("quickstart", "default", UID, 1)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    out = reconcile_job(
        job, quickstart_raw(), FineTuneJobStatus(), [], now, planner=default_planner()
    )
    assert out.evaluation.ok, out.evaluation.failure_message
    assert out.status.phase == "Pending" and out.status.plan is not None
    workers = [
        o for o in out.actions.create if o["metadata"]["name"].startswith("quickstart-worker")
    ]
    assert len(workers) == out.status.plan.nodes
