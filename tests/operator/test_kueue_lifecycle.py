"""Kueue, the job's lifecycle around its Workload: the queue-name label removed (the job
leaves Kueue and gives its quota back), a flavor whose node labels contradict the job's own
selector, and the resource-in-use finalizer (pure reconcile passes)."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest

from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import Outcome, PodView, reconcile_job
from finetune_operator.reconcile.admission import QueueState, read_left_queue_state
from tests.operator.factories import make_plan, quickstart_raw
from tests.operator.test_kueue import QUEUE, _cond, admitted, kstep, workload
from tests.operator.test_reconcile import ALL, JOB, T0, cond, created, deleted, running


def _pass(status: FineTuneJobStatus, pods: list[PodView], queue: QueueState | None,
          seconds: float = 0, spec: dict[str, Any] | None = None) -> Outcome:  # fmt: skip
    return reconcile_job(JOB, spec or quickstart_raw(), status, pods, T0 + timedelta(seconds=seconds),
                         planner=lambda _: make_plan(2), ensured_generation=1, queue=queue)  # fmt: skip


def _message(out: Outcome, ctype: str = "Succeeded") -> str:
    return next(c for c in out.status.conditions if c.type == ctype).message


# ---------------------------------------------------------------- the queue-name label removed


def test_a_queued_job_records_its_workload_for_the_passes_after_the_label_is_gone() -> None:
    out = kstep(FineTuneJobStatus(), running(*ALL), admitted(2))
    assert out.status.workload == "qs"
    unlabelled = _pass(out.status, running(*ALL), None, 5)
    assert unlabelled.status.workload is None  # a job never queued reads no Workload


def test_removing_the_queue_label_stops_the_workers_then_deletes_the_workload() -> None:
    """Kueue refuses the change on a running job of its own integrations; here the job leaves
    Kueue: stopped as on an eviction (its quota still counted while pods run), the Workload
    deleted once they are gone, then it runs as a job without the label."""
    live = kstep(FineTuneJobStatus(), running(*ALL), admitted(2)).status
    held = admitted(2)
    leaving = read_left_queue_state(held, JOB.uid)
    assert leaving is not None and leaving.left and leaving.queue == QUEUE
    stop = _pass(live, running(*ALL), leaving, 5)
    assert sorted(deleted(stop)) == sorted(ALL) and created(stop) == []
    assert {d.reason for d in stop.actions.delete} == {"QueueLabelRemoved"}
    assert stop.actions.remove == ()  # not while its pods run: the quota stays counted
    assert stop.actions.workload is None and stop.actions.workload_status is None
    assert cond(stop.status, "Succeeded") == ("Unknown", "QueueLabelRemoved")
    assert "kueue.x-k8s.io/queue-name label was removed" in _message(stop)
    assert QUEUE in _message(stop) and stop.status.workload == "qs"
    assert any(e.reason == "QueueLabelRemoved" for e in stop.events)
    gone = _pass(stop.status, [], leaving, 10)
    assert [(r.kind, r.name) for r in gone.actions.remove] == [("Workload", "qs")]
    assert created(gone) == [] and gone.actions.workload_status is None
    # The Workload is gone: the job runs without Kueue, from its last checkpoint.
    assert read_left_queue_state(None, JOB.uid) is None
    free = _pass(gone.status, [], None, 15)
    assert created(free) == list(ALL) and free.status.workload is None


def test_removing_the_label_of_a_job_still_waiting_deletes_its_workload_at_once() -> None:
    pending = workload(_cond("QuotaReserved", "False", "Pending", "insufficient quota"))
    out = _pass(FineTuneJobStatus(), [], read_left_queue_state(pending, JOB.uid))
    assert [(r.kind, r.name) for r in out.actions.remove] == [("Workload", "qs")]
    assert created(out) == [] and out.actions.workload is None


@pytest.mark.parametrize("case", ["finished", "foreign", "absent"])
def test_a_workload_not_to_give_back_is_left_alone(case: str) -> None:
    wl: dict[str, Any] | None = admitted(2)
    assert wl is not None
    if case == "finished":
        wl["status"]["conditions"].append(_cond("Finished", "True", "Succeeded"))
    elif case == "foreign":
        wl["metadata"]["ownerReferences"][0]["uid"] = "an-older-job"
    else:
        wl = None
    assert read_left_queue_state(copy.deepcopy(wl), JOB.uid) is None


def test_a_suspended_job_leaving_kueue_deletes_its_workload_too() -> None:
    leaving = read_left_queue_state(admitted(2), JOB.uid)
    out = _pass(FineTuneJobStatus(), [], leaving, spec=quickstart_raw() | {"suspend": True})
    assert [(r.kind, r.name) for r in out.actions.remove] == [("Workload", "qs")]
    assert out.actions.workload is None  # not deactivated: deleted
