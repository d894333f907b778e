"""The PodGroup's status as the job reports it: reading both schedulers' statuses (pure), and
what a reconcile pass then says in GangScheduled, Succeeded's message and Events."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from datetime import timedelta
from typing import Any

import pytest
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from finetune_operator.api.constants import (
    COND_GANG_SCHEDULED,
    COND_SUCCEEDED,
    REASON_BACKOFF_LIMIT_EXCEEDED,
    REASON_GANG_SCHEDULED,
    REASON_GANG_STATUS_UNKNOWN,
    REASON_GANG_TIMED_OUT,
    REASON_QUEUED,
    REASON_WAITING_FOR_GANG,
)
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import Outcome, reconcile_job
from finetune_operator.reconcile.admission import QueueState
from finetune_operator.reconcile.apply import ClusterApi
from finetune_operator.reconcile.conditions import Want, find, set_condition
from finetune_operator.reconcile.gang import (
    READ_WHILE_RUNNING,
    GangReading,
    GangVerdict,
    pod_group_to_read,
    read_gang,
    released_gang,
    with_gang,
)
from tests.operator.factories import make_plan, quickstart_raw
from tests.operator.test_reconcile import ALL, JOB, T0, cond, pod, running, step

UNSCHEDULABLE = {
    "type": "Unschedulable",
    "status": "True",
    "reason": "NotEnoughResources",
    "message": "2/2 tasks in gang unschedulable: pod group is not ready, 2 Pending, 2 minAvailable",
    "lastTransitionTime": "2026-01-01T12:00:00Z",
    "transitionID": "a1",
}


def group(status: dict[str, Any] | None, min_member: int = 2) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": "qs"}, "spec": {"minMember": min_member}}
    if status is not None:
        body["status"] = status
    return body


@pytest.mark.parametrize(
    ("status", "verdict", "placed", "reason"),
    [
        # Volcano: admitted by its queue, cannot be placed; its condition says why.
        ({"phase": "Inqueue", "conditions": [UNSCHEDULABLE]}, GangVerdict.WAITING, 0, "NotEnoughResources"),
        ({"phase": "Pending", "conditions": [UNSCHEDULABLE]}, GangVerdict.WAITING, 0, "NotEnoughResources"),
        # Volcano's Unknown: some placed (and running), the rest cannot be.
        ({"phase": "Unknown", "running": 1, "conditions": [UNSCHEDULABLE]}, GangVerdict.WAITING, 1, "NotEnoughResources"),
        ({"phase": "Running", "running": 2, "conditions": [{**UNSCHEDULABLE, "status": "False"}]},
         GangVerdict.SCHEDULED, 2, ""),
        ({"phase": "Completed", "succeeded": 2}, GangVerdict.SCHEDULED, 2, ""),
        # Coscheduling: counts and phase only, no conditions.
        ({"phase": "Pending"}, GangVerdict.WAITING, 0, ""),
        ({"phase": "Scheduling", "running": 1}, GangVerdict.SCHEDULED, 1, ""),
        ({"phase": "Finished", "succeeded": 2}, GangVerdict.SCHEDULED, 2, ""),
        # Older Coscheduling releases: a `scheduled` count and a timeout phase.
        ({"phase": "PreScheduling", "scheduled": 1}, GangVerdict.WAITING, 1, ""),
        ({"phase": "ScheduleTimeout", "scheduled": 1}, GangVerdict.TIMED_OUT, 1, ""),
        # The scheduler has not looked at the group yet; a phase nobody documented.
        ({}, GangVerdict.NOT_REPORTED, 0, ""),
        (None, GangVerdict.NOT_REPORTED, 0, ""),
        ({"phase": "Reticulating", "running": "lots"}, GangVerdict.UNKNOWN, 0, ""),
    ],
    ids=["volcano-inqueue", "volcano-pending", "volcano-partial", "volcano-running",
         "volcano-completed", "cosched-pending", "cosched-scheduling", "cosched-finished",
         "cosched-old-prescheduling", "cosched-old-timeout", "empty-status", "no-status",
         "unknown-phase"],
)  # fmt: skip
def test_read_gang(
    status: dict[str, Any] | None, verdict: GangVerdict, placed: int, reason: str
) -> None:
    reading = read_gang(group(status), "qs")
    assert (reading.verdict, reading.placed, reading.min_member, reading.reason) == (
        verdict,
        placed,
        2,
        reason,
    )


def test_what_the_user_reads() -> None:
    waiting = read_gang(group({"phase": "Inqueue", "conditions": [UNSCHEDULABLE]}), "qs")
    assert waiting.describe() == (
        "waiting for gang: 0/2 pods placed (PodGroup qs Inqueue): NotEnoughResources: "
        "2/2 tasks in gang unschedulable: pod group is not ready, 2 Pending, 2 minAvailable"
    )
    assert read_gang(None, "qs").describe() == "PodGroup qs: not created yet"
    assert "has not reported" in read_gang(group({}), "qs").describe()
    odd = read_gang(group({"phase": "Reticulating"}), "qs").describe()
    assert "'Reticulating' is not one this operator knows" in odd
    refused = read_gang(None, "qs", unreadable="PodGroup qs (HTTP 403 Forbidden): ...")
    assert refused.verdict is GangVerdict.UNKNOWN
    assert refused.describe() == "PodGroup qs: PodGroup qs (HTTP 403 Forbidden): ..."


def gang_spec(scheduler: str = "volcano") -> dict[str, Any]:
    raw = quickstart_raw()
    raw["resources"]["gangScheduling"] = {"scheduler": scheduler}
    return raw


def pending_pass(
    status: FineTuneJobStatus, now: Any, spec: dict[str, Any] | None = None
) -> Outcome:
    pods = [pod("qs-rdzv", "Running", ready=True), pod("qs-worker-0"), pod("qs-worker-1")]
    return step(status, pods, now, spec=spec or gang_spec())


def test_which_jobs_read_their_pod_group() -> None:
    out = pending_pass(FineTuneJobStatus(), T0)
    assert pod_group_to_read(out, T0) == ("scheduling.volcano.sh/v1beta1", "qs")
    cosched = pending_pass(FineTuneJobStatus(), T0, gang_spec("coscheduling"))
    assert pod_group_to_read(cosched, T0) == ("scheduling.x-k8s.io/v1alpha1", "qs")
    # No gang, or the gang switched off: nothing to read.
    assert pod_group_to_read(pending_pass(FineTuneJobStatus(), T0, quickstart_raw()), T0) is None
    assert pod_group_to_read(pending_pass(FineTuneJobStatus(), T0, gang_spec("none")), T0) is None
    # Queued by Kueue (not admitted): no worker to place, no PodGroup yet.
    queued = reconcile_job(JOB, gang_spec(), FineTuneJobStatus(), [], T0,
                           planner=lambda _: make_plan(2), queue=QueueState("q"))  # fmt: skip
    assert cond(queued.status, COND_SUCCEEDED) == ("Unknown", REASON_QUEUED)
    assert pod_group_to_read(queued, T0) is None


def test_a_waiting_gang_then_placed_as_the_job_reports_it() -> None:
    old = pending_pass(FineTuneJobStatus(), T0).status
    # Volcano cannot place the group: GangScheduled=False with its reason, in Succeeded's
    # message too (what `kubectl describe ftj` shows), and one Event.
    waiting = read_gang(group({"phase": "Inqueue", "conditions": [UNSCHEDULABLE]}), "qs")
    t1 = T0 + timedelta(seconds=10)
    out = with_gang(pending_pass(old, t1), old, waiting, t1)
    assert cond(out.status, COND_GANG_SCHEDULED) == ("False", REASON_WAITING_FOR_GANG)
    assert out.status.phase == "Pending"
    succeeded = find(out.status.conditions, COND_SUCCEEDED)
    assert succeeded is not None
    assert succeeded.message.startswith("0/2 worker pods ready")
    assert "; waiting for gang: 0/2 pods placed (PodGroup qs Inqueue): NotEnoughResources" in (
        succeeded.message
    )
    gang_events = [e for e in out.events if e.reason == REASON_WAITING_FOR_GANG]
    assert [e.type for e in gang_events] == ["Normal"]
    assert gang_events[0].message.startswith("GangScheduled=False: waiting for gang: 0/2")
    # The next pass, still waiting: the same status (no patch), no new Event.
    t2 = t1 + timedelta(seconds=10)
    again = with_gang(pending_pass(out.status, t2), out.status, waiting, t2)
    assert again.status == out.status
    assert not [e for e in again.events if e.reason == REASON_WAITING_FOR_GANG]
    # Placed and running: GangScheduled=True with one Event, Succeeded back to the pods' word.
    placed = read_gang(group({"phase": "Running", "running": 2}), "qs")
    t3 = t2 + timedelta(seconds=10)
    live = step(again.status, running(*ALL), t3, spec=gang_spec())
    done = with_gang(live, again.status, placed, t3)
    assert cond(done.status, COND_GANG_SCHEDULED) == ("True", REASON_GANG_SCHEDULED)
    assert done.status.phase == "Running"
    assert "gang" not in (find(done.status.conditions, COND_SUCCEEDED) or succeeded).message
    assert [e.reason for e in done.events if e.reason == REASON_GANG_SCHEDULED] == [
        REASON_GANG_SCHEDULED
    ]
    # Running with its gang placed: not read again.
    assert pod_group_to_read(done, t3) is None
    assert released_gang(done) is None
    # Suspended: the group is given back, and the job no longer claims a placement.
    suspended_spec = {**gang_spec(), "suspend": True}
    t4 = t3 + timedelta(seconds=10)
    held = step(done.status, [], t4, spec=suspended_spec)
    assert pod_group_to_read(held, t4) is None
    released = released_gang(held)
    assert released is not None
    after = with_gang(held, done.status, released, t4)
    assert cond(after.status, COND_GANG_SCHEDULED) == ("Unknown", REASON_WAITING_FOR_GANG)
    gang_cond = find(after.status.conditions, COND_GANG_SCHEDULED)
    assert (
        gang_cond is not None
        and gang_cond.message == "PodGroup qs: none while the job is suspended"
    )
    assert released_gang(after) is None  # said once


@pytest.mark.parametrize(
    ("reading", "expected", "event"),
    [
        (GangReading(GangVerdict.TIMED_OUT, "qs", "ScheduleTimeout", 2, 1),
         ("False", REASON_GANG_TIMED_OUT), "Warning"),
        (read_gang(None, "qs", unreadable="PodGroup qs (HTTP 404 Not Found): not served"),
         ("Unknown", REASON_GANG_STATUS_UNKNOWN), "Warning"),
        (read_gang(None, "qs"), ("Unknown", REASON_WAITING_FOR_GANG), None),
    ],
    ids=["timed-out", "unreadable", "not-created-yet"],
)  # fmt: skip
def test_other_verdicts(reading: GangReading, expected: tuple[str, str], event: str | None) -> None:
    old = pending_pass(FineTuneJobStatus(), T0).status
    t1 = T0 + timedelta(seconds=10)
    out = with_gang(pending_pass(old, t1), old, reading, t1)
    assert cond(out.status, COND_GANG_SCHEDULED) == expected
    types = [e.type for e in out.events if e.message.startswith(f"{COND_GANG_SCHEDULED}=")]
    assert types == ([event] if event else [])


@pytest.mark.parametrize(
    ("err", "expected"),
    [
        # The group itself absent (the API server names it): not created yet, no error.
        (ApiException(status=404, reason="Not Found"), None),
        (ApiException(status=404, reason="Not Found"), "the API server does not serve"),
        (ApiException(status=403, reason="Forbidden"), "the operator may not manage"),
        (ApiException(status=500, reason="Internal Server Error"), "HTTP 500"),
    ],
    ids=["group-absent", "crd-missing", "forbidden", "server-error"],
)
def test_a_refused_read_is_reported_not_raised(err: ApiException, expected: str | None) -> None:
    if expected is None:
        err.body = json.dumps({"kind": "Status", "details": {"name": "qs", "kind": "podgroups"}})
    cluster = ClusterApi(ApiClient())

    def refuse(*_: Any, **__: Any) -> Any:
        raise err

    cluster.custom.get_namespaced_custom_object = refuse  # type: ignore[method-assign]
    found, why = asyncio.run(cluster.read_pod_group("ns", "scheduling.volcano.sh/v1beta1", "qs"))
    assert found is None
    if expected is None:
        assert why == ""
    else:
        assert why.startswith("PodGroup qs (") and expected in why
        assert read_gang(found, "qs", why).verdict is GangVerdict.UNKNOWN


def test_a_running_job_stops_reading_a_gang_never_seen_placed() -> None:
    """A scheduler that writes no status (or a group the operator may not read) would cost a
    GET every pass for the whole run: a running job reads it READ_WHILE_RUNNING at most."""
    old = pending_pass(FineTuneJobStatus(), T0).status
    live = step(old, running(*ALL), T0, spec=gang_spec())
    silent = with_gang(live, old, read_gang(group(None), "qs"), T0)  # no status written
    assert cond(silent.status, COND_GANG_SCHEDULED) == ("Unknown", REASON_WAITING_FOR_GANG)
    assert silent.status.phase == "Running"
    assert pod_group_to_read(silent, T0 + timedelta(seconds=30)) is not None
    late = T0 + READ_WHILE_RUNNING + timedelta(seconds=1)
    assert (
        pod_group_to_read(step(silent.status, running(*ALL), late, spec=gang_spec()), late) is None
    )


def test_a_failed_read_keeps_the_verdict_read_before() -> None:
    """An API server hiccup between two readings of a waiting gang: no flap to Unknown and
    back, and no Event for either."""
    old = pending_pass(FineTuneJobStatus(), T0).status
    waiting = read_gang(group({"phase": "Inqueue", "conditions": [UNSCHEDULABLE]}), "qs")
    out = with_gang(pending_pass(old, T0), old, waiting, T0)
    t1 = T0 + timedelta(seconds=10)
    hiccup = read_gang(None, "qs", unreadable="PodGroup qs (HTTP 500 Internal Server Error)")
    kept = with_gang(pending_pass(out.status, t1), out.status, hiccup, t1)
    assert cond(kept.status, COND_GANG_SCHEDULED) == ("False", REASON_WAITING_FOR_GANG)
    assert not [e for e in kept.events if e.message.startswith(f"{COND_GANG_SCHEDULED}=")]
    # With no verdict yet, the failure is what there is to say.
    first = with_gang(pending_pass(old, t1), old, hiccup, t1)
    assert cond(first.status, COND_GANG_SCHEDULED) == ("Unknown", REASON_GANG_STATUS_UNKNOWN)


def test_a_job_finished_while_its_gang_waited_no_longer_says_it_waits() -> None:
    old = pending_pass(FineTuneJobStatus(), T0).status
    waiting = read_gang(group({"phase": "Inqueue", "conditions": [UNSCHEDULABLE]}), "qs")
    out = with_gang(pending_pass(old, T0), old, waiting, T0)
    t1 = T0 + timedelta(seconds=10)
    failed = Want("False", REASON_BACKOFF_LIMIT_EXCEEDED, "gave up")
    conds = set_condition(out.status.conditions, COND_SUCCEEDED, failed, t1, 1)
    done = dataclasses.replace(out, status=out.status.model_copy(update={"conditions": conds}))
    assert pod_group_to_read(done, t1) is None
    released = released_gang(done)
    assert released is not None
    after = with_gang(done, done.status, released, t1)
    assert cond(after.status, COND_GANG_SCHEDULED) == ("Unknown", REASON_WAITING_FOR_GANG)
    assert released_gang(after) is None  # said once
    # A gang seen placed keeps saying so once the job is over: that is what happened.
    placed = with_gang(done, done.status, read_gang(group({"phase": "Running"}), "qs"), t1)
    assert released_gang(placed) is None
