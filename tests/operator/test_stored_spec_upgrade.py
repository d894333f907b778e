"""An operator upgrade never turns a job it (or an older operator) already planned into
InvalidSpec for a spec form the new release refuses: the job runs on with the old meaning,
the Planned condition says what to change, and one Warning Event says it once."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from finetune_operator.api.constants import COND_FAILED, COND_PLANNED, REASON_DEPRECATED_SPEC
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import JobRef, Outcome, reconcile_job
from finetune_operator.reconcile.conditions import find
from tests.operator.factories import UID, make_plan, quickstart_raw
from tests.operator.test_reconcile import ALL, JOB, T0, running

STALE = {
    "empty-output-uri": ({"uri": ""}, 'spec.output.uri is ""'),
    "merge-lora-of-a-full-fine-tune": ({"mergeLora": True}, "spec.output.mergeLora is true"),
}


def _pass(
    spec: dict[str, Any], status: FineTuneJobStatus, at: datetime, job: JobRef = JOB
) -> Outcome:
    return reconcile_job(
        job,
        spec,
        status,
        running(*ALL),
        at,
        planner=lambda _: make_plan(2),
        ensured_generation=job.generation,
    )


@pytest.mark.parametrize("form", list(STALE))
def test_a_planned_job_runs_on_with_the_old_meaning(form: str) -> None:
    output, wording = STALE[form]
    stale = {**quickstart_raw(), "output": output}
    # Planned by the older operator, which accepted the form; workers are running.
    accepted = _pass(quickstart_raw(), FineTuneJobStatus(), T0).status
    upgraded = _pass(stale, accepted, T0 + timedelta(seconds=5))
    assert upgraded.evaluation.ok and upgraded.status.phase == "Running"
    assert upgraded.actions.delete == () and upgraded.actions.create == ()
    assert upgraded.evaluation.spec is not None
    assert upgraded.evaluation.spec.output.uri is None
    assert upgraded.evaluation.spec.output.merge_lora is False
    planned = find(upgraded.status.conditions, COND_PLANNED)
    failed = find(upgraded.status.conditions, COND_FAILED)
    assert planned is not None and planned.status == "True" and wording in planned.message
    assert failed is not None and failed.status == "False"
    warnings = [e for e in upgraded.events if e.reason == REASON_DEPRECATED_SPEC]
    assert len(warnings) == 1 and warnings[0].type == "Warning" and wording in warnings[0].message
    # Said once: the next pass posts no second Event, and keeps the condition's message.
    again = _pass(stale, upgraded.status, T0 + timedelta(seconds=10))
    assert not [e for e in again.events if e.reason == REASON_DEPRECATED_SPEC]
    # A suspend toggle bumps the generation (the plan is made again): still not refused.
    suspended = {**stale, "suspend": True}
    toggled = _pass(suspended, again.status, T0 + timedelta(seconds=15), JobRef("qs", "ns", UID, 2))
    assert toggled.evaluation.ok and toggled.status.phase == "Suspended"


@pytest.mark.parametrize("form", list(STALE))
def test_a_new_job_with_the_form_is_still_refused(form: str) -> None:
    stale = {**quickstart_raw(), "output": STALE[form][0]}
    out = _pass(stale, FineTuneJobStatus(), T0)
    failed = find(out.status.conditions, COND_FAILED)
    assert failed is not None and (failed.status, failed.reason) == ("True", "InvalidSpec")


def test_a_job_the_refusing_release_failed_runs_again_after_a_suspend_toggle() -> None:
    stale = {**quickstart_raw(), "output": {"mergeLora": True}}
    accepted = _pass(quickstart_raw(), FineTuneJobStatus(), T0).status
    # What the release without spec_compat wrote: InvalidSpec at generation 1, plan kept.
    failed = _pass(stale, FineTuneJobStatus(), T0).status.model_copy(update={"plan": accepted.plan})
    again = _pass(stale, failed, T0 + timedelta(seconds=5))
    assert again.status.phase == "Failed"  # sticky at its generation, as any refusal
    resumed = _pass(stale, failed, T0 + timedelta(seconds=9), JobRef("qs", "ns", UID, 3))
    assert resumed.evaluation.ok and resumed.status.phase != "Failed"
    assert [e.reason for e in resumed.events if e.reason == REASON_DEPRECATED_SPEC] == [
        REASON_DEPRECATED_SPEC
    ]


def test_the_refusal_of_a_new_job_names_the_field_as_ftjob_plan_does() -> None:
    """On create, the operator's condition is the only refusal a kubectl user sees (the CRD's
    transition rules skip creates): the field, not pydantic's 'spec.spec' or 'Value error'."""
    raw = quickstart_raw()
    raw["output"] = {"mergeLora": True}
    out = reconcile_job(JOB, raw, FineTuneJobStatus(), [], T0, planner=lambda _: make_plan(2))
    failed = find(out.status.conditions, "Failed")
    assert failed is not None and failed.reason == "InvalidSpec"
    assert failed.message.startswith("spec: output.mergeLora is true"), failed.message
    assert "spec.spec" not in failed.message and "Value error" not in failed.message
