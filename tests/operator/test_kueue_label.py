"""Kueue's queue-name label put on, or changed on, a job that is already running (pure
reconcile passes): Kueue's webhooks refuse both on a running job; the operator, which has no
webhook, keeps the job running and says when the label takes effect."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import Outcome, PodView, reconcile_job
from finetune_operator.reconcile.admission import QueueState, read_queue_state
from finetune_operator.reconcile.conditions import find
from tests.operator.factories import make_plan, quickstart_raw
from tests.operator.test_kueue import QUEUE, SPOT, _cond, admitted, workload
from tests.operator.test_reconcile import ALL, JOB, T0, cond, created, deleted, pod, running

APPLIED = "QueueLabelApplied"
SUSPENDED = quickstart_raw() | {"suspend": True}


def _pass(status: FineTuneJobStatus, pods: list[PodView], queue: QueueState | None,
          seconds: float = 0, spec: dict[str, Any] | None = None) -> Outcome:  # fmt: skip
    return reconcile_job(JOB, spec or quickstart_raw(), status, pods, T0 + timedelta(seconds=seconds),
                         planner=lambda _: make_plan(2), ensured_generation=1, queue=queue)  # fmt: skip


def _not_created_yet(queue: str = QUEUE) -> QueueState:
    """The label is there, the Workload is not (Kueue served, the Workload known absent)."""
    return read_queue_state(queue, None, {})


def _running_outside_kueue() -> FineTuneJobStatus:
    """A job without the label, its workers up."""
    return _pass(FineTuneJobStatus(), running(*ALL), None).status


def test_the_label_added_to_a_running_job_leaves_it_running_outside_kueue() -> None:
    live = _running_outside_kueue()
    assert live.phase == "Running" and find(live.conditions, APPLIED) is None
    out = _pass(live, running(*ALL), _not_created_yet(), 5)
    assert deleted(out) == [] and created(out) == []
    assert out.actions.workload is None and out.status.workload is None  # not handed to Kueue
    assert out.status.phase == "Running"
    assert cond(out.status, APPLIED) == ("False", "AddedWhileRunning")
    message = next(c for c in out.status.conditions if c.type == APPLIED).message
    assert "kueue.x-k8s.io/queue-name" in message and QUEUE in message
    assert "spec.suspend" in message  # what hands it over
    (warning,) = [e for e in out.events if e.reason == "AddedWhileRunning"]
    assert warning.type == "Warning" and QUEUE in warning.message
    # The next pass says nothing new (no second Event).
    again = _pass(out.status, running(*ALL), _not_created_yet(), 10)
    assert again.actions.empty and not [e for e in again.events if e.reason == "AddedWhileRunning"]


def test_a_job_running_outside_kueue_stays_so_through_a_pass_without_workers() -> None:
    """A worker group replaced whole (a restart) is not the job stopping: it is recreated
    outside Kueue rather than queued."""
    live = _running_outside_kueue()
    outside = _pass(live, running(*ALL), _not_created_yet(), 5).status
    failed = [pod("qs-rdzv", "Running", ready=True),
              pod("qs-worker-0", "Failed", exit_code=1, finished=T0),
              pod("qs-worker-1", "Failed", exit_code=1, finished=T0)]  # fmt: skip
    out = _pass(outside, failed, _not_created_yet(), 600)
    # Replaced: deleted, then recreated. Their torchrun agents ended on an error, which shuts
    # the rendezvous down for good (reconcile/budget.py): the store is replaced with them.
    assert sorted(deleted(out)) == ["qs-rdzv", "qs-worker-0", "qs-worker-1"]
    assert out.actions.workload is None and cond(out.status, APPLIED)[1] == "AddedWhileRunning"
    gone = _pass(out.status, [], _not_created_yet(), 605)
    assert created(gone) == ["qs-rdzv", "qs-worker-0", "qs-worker-1"]
    assert gone.actions.workload is None
    assert gone.status.workload is None and cond(gone.status, APPLIED)[1] == "AddedWhileRunning"


def test_a_job_running_outside_kueue_is_handed_to_it_once_suspended() -> None:
    outside = _pass(_running_outside_kueue(), running(*ALL), _not_created_yet(), 5).status
    stop = _pass(outside, running(*ALL), _not_created_yet(), 10, spec=SUSPENDED)
    assert sorted(deleted(stop)) == sorted(ALL)
    assert stop.actions.workload is not None and stop.actions.workload["spec"]["active"] is False
    assert stop.actions.workload["spec"]["queueName"] == QUEUE and stop.status.workload == "qs"
    assert cond(stop.status, APPLIED) == ("True", "Applied")
    assert [e.type for e in stop.events if e.reason == "Applied"] == ["Normal"]
    # Resumed: it waits for Kueue's admission like any labelled job.
    inactive = workload(_cond("QuotaReserved", "False", "Pending"))
    inactive["spec"]["active"] = False
    resumed = _pass(stop.status, [], read_queue_state(QUEUE, inactive, {}), 15)
    assert created(resumed) == [] and resumed.status.phase == "Pending"
    assert resumed.actions.workload is not None and resumed.actions.workload["spec"]["active"]
    assert cond(resumed.status, "Succeeded") == ("Unknown", "Queued")


def test_a_job_running_outside_kueue_that_finishes_is_never_queued() -> None:
    outside = _pass(_running_outside_kueue(), running(*ALL), _not_created_yet(), 5).status
    done = [pod("qs-rdzv", "Running", ready=True),
            pod("qs-worker-0", "Succeeded", exit_code=0), pod("qs-worker-1", "Succeeded", exit_code=0)]  # fmt: skip
    out = _pass(outside, done, _not_created_yet(), 10)
    assert out.status.phase == "Succeeded" and out.actions.workload is None
    after = _pass(out.status, done[1:], _not_created_yet(), 15)
    assert after.actions.workload is None and created(after) == []
    # Its status names no Workload (none was ever written) and keeps saying why.
    assert after.status.workload is None
    assert cond(after.status, APPLIED) == ("False", "AddedWhileRunning")


def test_the_label_added_to_a_suspended_job_hands_it_to_kueue_at_once() -> None:
    """As Kueue does: the change is allowed on a suspended job, and its Workload is created
    (inactive here until the job is resumed, spec.suspend being the user's alone)."""
    paused = _pass(FineTuneJobStatus(), [], None, spec=SUSPENDED).status
    assert paused.phase == "Suspended"
    out = _pass(paused, [], _not_created_yet(), 5, spec=SUSPENDED)
    assert out.actions.workload is not None and out.actions.workload["spec"]["active"] is False
    assert find(out.status.conditions, APPLIED) is None and out.status.workload == "qs"


def test_the_label_on_a_job_with_no_worker_up_queues_it() -> None:
    """Nothing runs yet (the operator has not created the pods, or they are all gone): it
    waits for Kueue's admission, as a job created with the label does."""
    out = _pass(FineTuneJobStatus(), [], _not_created_yet())
    assert created(out) == [] and out.actions.workload is not None
    assert find(out.status.conditions, APPLIED) is None


def test_the_label_removed_from_a_job_running_outside_kueue_drops_the_condition() -> None:
    outside = _pass(_running_outside_kueue(), running(*ALL), _not_created_yet(), 5).status
    out = _pass(outside, running(*ALL), None, 10)
    assert find(out.status.conditions, APPLIED) is None
    assert deleted(out) == [] and out.actions.workload is None


def test_the_label_changed_on_an_admitted_running_job_runs_on_in_its_queue() -> None:
    live = _pass(FineTuneJobStatus(), running(*ALL), read_queue_state(QUEUE, admitted(2), {"spot": SPOT})).status  # fmt: skip
    moved = read_queue_state("team-b", admitted(2), {"spot": SPOT})
    out = _pass(live, running(*ALL), moved, 5)
    assert deleted(out) == [] and out.actions.workload is None  # not moved while admitted
    assert cond(out.status, APPLIED) == ("False", "ChangedWhileRunning")
    message = next(c for c in out.status.conditions if c.type == APPLIED).message
    assert "team-b" in message and QUEUE in message
    assert [e.type for e in out.events if e.reason == "ChangedWhileRunning"] == ["Warning"]
    # Evicted, its pods gone and the quota given back: the Workload moves to team-b.
    released = workload(_cond("QuotaReserved", "False", "Pending"), _cond("Evicted", "True", "Preempted"))  # fmt: skip
    after = _pass(out.status, [], read_queue_state("team-b", released, {}), 10)
    assert after.actions.workload is not None and after.actions.workload_rewrite
    assert after.actions.workload["spec"]["queueName"] == "team-b"
    assert cond(after.status, APPLIED) == ("True", "Applied")


def test_a_job_leaving_kueue_awaits_its_pods_so_their_deletion_nudges_it() -> None:
    """The label removed: the Workload is deleted once the workers are gone. The pass that
    stops them asks to be nudged by their deletion; the one that finds them gone does not."""
    from finetune_operator.reconcile.admission import read_left_queue_state

    live = _pass(FineTuneJobStatus(), running(*ALL), read_queue_state(QUEUE, admitted(2), {"spot": SPOT})).status  # fmt: skip
    assert not _pass(live, running(*ALL), read_queue_state(QUEUE, admitted(2), {"spot": SPOT}), 1).actions.await_pods_gone  # fmt: skip
    leaving = read_left_queue_state(admitted(2), JOB.uid)
    stop = _pass(live, running(*ALL), leaving, 5)
    assert deleted(stop) and stop.actions.await_pods_gone
    going = [pod(n, "Running", deleting=True) for n in ALL]
    assert _pass(stop.status, going, leaving, 6).actions.await_pods_gone
    gone = _pass(stop.status, [], leaving, 7)
    assert gone.actions.remove and not gone.actions.await_pods_gone
    # Finished workers kept for their logs are not awaited.
    done = [pod("qs-worker-0", "Succeeded", exit_code=0), pod("qs-worker-1", "Succeeded", exit_code=0)]  # fmt: skip
    over = _pass(live, done, read_queue_state(QUEUE, admitted(2), {"spot": SPOT}), 9)
    assert over.status.phase == "Succeeded" and not over.actions.await_pods_gone


def test_the_deletion_of_an_awaited_pod_nudges_its_job_and_no_other() -> None:
    import asyncio

    from finetune_operator.api.constants import LABEL_JOB
    from finetune_operator.handlers.workloads import await_pods_gone, forget_nudge, job_pod_deleted

    memo: dict[str, Any] = {"nudged": {}, "awaiting_pods": set()}

    def deleted_pod(job: str, event: str = "DELETED") -> dict[Any, float]:
        body = {"metadata": {"name": f"{job}-worker-0", "labels": {LABEL_JOB: job}}}
        asyncio.run(job_pod_deleted(namespace="ns", body=body, memo=memo, type=event))
        nudged: dict[Any, float] = memo["nudged"]
        return nudged

    await_pods_gone(memo, ("ns", "qs"), True)
    assert deleted_pod("qs", "MODIFIED") == {}  # a deletionTimestamp is not gone yet
    assert deleted_pod("other") == {}
    assert set(deleted_pod("qs")) == {("ns", "qs")}
    memo["nudged"].clear()
    await_pods_gone(memo, ("ns", "qs"), False)
    assert deleted_pod("qs") == {}
    await_pods_gone(memo, ("ns", "qs"), True)
    forget_nudge(memo, ("ns", "qs"))  # the job deleted
    assert memo["awaiting_pods"] == set() and deleted_pod("qs") == {}


FORBIDDEN = (
    "Workload qs (HTTP 403 Forbidden): the operator may not read workloads.kueue.x-k8s.io: "
    "set the chart value kueue.enabled=true; the job waits"
)


def _message(out: Outcome) -> str:
    found = find(out.status.conditions, APPLIED)
    assert found is not None
    return found.message


def test_a_labelled_job_kueue_cannot_be_read_for_waits_and_says_so() -> None:
    """The chart's kueue.enabled off while Kueue runs: the job is not run outside the quota,
    and it is not left looking queued either: a Warning names the chart value."""
    blind = read_queue_state(QUEUE, None, {}, unreadable=FORBIDDEN)
    out = _pass(FineTuneJobStatus(), [], blind)
    assert created(out) == [] and out.actions.workload is None
    assert out.status.phase == "Pending" and cond(out.status, APPLIED) == ("False", "KueueUnreadable")  # fmt: skip
    assert "kueue.enabled" in _message(out) and "no pod starts" in _message(out)
    assert [e.type for e in out.events if e.reason == "KueueUnreadable"] == ["Warning"]
    again = _pass(out.status, [], blind, 5)
    assert not [e for e in again.events if e.reason == "KueueUnreadable"] and created(again) == []


def test_admitted_workers_kueue_can_no_longer_be_read_for_are_kept_and_said_so() -> None:
    live = _pass(FineTuneJobStatus(), running(*ALL), read_queue_state(QUEUE, admitted(2), {"spot": SPOT})).status  # fmt: skip
    blind = read_queue_state(QUEUE, None, {}, unreadable=FORBIDDEN)
    out = _pass(live, running(*ALL), blind, 5)
    assert deleted(out) == [] and out.status.phase == "Running"
    assert cond(out.status, APPLIED) == ("False", "KueueUnreadable")
    assert "running workers kept" in _message(out) and "kueue.enabled" in _message(out)
    assert [e.type for e in out.events if e.reason == "KueueUnreadable"] == ["Warning"]
    # Readable again (the chart value set): the label is in effect, said once.
    back = _pass(out.status, running(*ALL), read_queue_state(QUEUE, admitted(2), {"spot": SPOT}), 10)  # fmt: skip
    assert cond(back.status, APPLIED) == ("True", "Applied") and deleted(back) == []
    assert [e.type for e in back.events if e.reason == "Applied"] == ["Normal"]


def test_a_flavor_that_cannot_be_read_is_not_kueue_unreadable() -> None:
    """The Workload itself is read (and written): only WorkersReady says the admission's
    flavor cannot be read; QueueLabelApplied is for a Workload that cannot be."""
    live = _pass(FineTuneJobStatus(), running(*ALL), read_queue_state(QUEUE, admitted(2), {"spot": SPOT})).status  # fmt: skip
    no_flavor = read_queue_state(QUEUE, admitted(2), {})
    assert no_flavor.unknown and not no_flavor.unreadable
    out = _pass(live, running(*ALL), no_flavor, 5)
    assert find(out.status.conditions, APPLIED) is None and deleted(out) == []
    ready = find(out.status.conditions, "WorkersReady")
    assert ready is not None and "ResourceFlavor spot" in ready.message
