"""Kueue, the job's lifecycle around its Workload: the queue-name label removed (the job
leaves Kueue and gives its quota back), a flavor whose node labels contradict the job's own
selector, and the resource-in-use finalizer (pure reconcile passes)."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest

from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import Outcome, PodView, reconcile_job
from finetune_operator.reconcile.admission import QueueState, read_left_queue_state
from finetune_operator.resources.workload import build_workload
from tests.operator.factories import make_plan, quickstart_raw
from tests.operator.test_kueue import QUEUE, SPOT, _cond, admitted, kstep, workload
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
        wl["metadata"]["finalizers"] = []  # removed already: nothing left to do
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


def test_a_left_job_whose_workload_cannot_be_read_keeps_it_in_mind() -> None:
    """The label removed, then the Workload unreadable for a while (no permission, Kueue
    being upgraded): status.workload is kept so a later pass still gives the Workload (and
    its quota) back, the running workers are kept, none is added, nothing is deleted blind.
    Forgetting it would let the job run outside Kueue while its Workload holds quota."""
    live = kstep(FineTuneJobStatus(), running(*ALL), admitted(2)).status
    why = "Workload qs: the operator may not read workloads.kueue.x-k8s.io"
    blind = read_left_queue_state(None, JOB.uid, unreadable=why)
    assert blind is not None and blind.left and blind.unknown
    held = _pass(live, running(*ALL), blind, 5)
    assert held.status.workload == "qs"
    assert deleted(held) == [] and created(held) == [] and held.actions.remove == ()
    assert why in _message(held, "WorkersReady") and "running workers kept" in _message(
        held, "WorkersReady"
    )
    # Nothing running: nothing started either, until the Workload can be read.
    idle = _pass(live, [], blind, 10)
    assert created(idle) == [] and idle.actions.remove == () and idle.status.workload == "qs"
    assert why in _message(idle) and cond(idle.status, "Succeeded")[1] == "QueueLabelRemoved"
    # Readable again: it leaves Kueue as usual.
    leaving = read_left_queue_state(admitted(2), JOB.uid)
    gone = _pass(idle.status, [], leaving, 15)
    assert [(r.kind, r.name) for r in gone.actions.remove] == [("Workload", "qs")]


# ---------------------------------------------------------------- a flavor contradicting the job


def _admitted_for(raw: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """Admitted at 2 to the spot flavor, written for the job as `raw` makes it."""
    wl = admitted(2, **kw)
    spec = FineTuneJobSpec.model_validate(raw)
    wl["spec"] = build_workload(JOB.owner, spec, make_plan(2), QUEUE)["spec"]
    return wl


def _on_demand() -> dict[str, Any]:
    """The job, pinned by its own nodeSelector to the pool the spot flavor's label contradicts."""
    raw = quickstart_raw()
    raw["resources"]["nodeSelector"] = {"cloud.example.com/pool": "on-demand"}
    return raw


def test_a_flavor_label_contradicting_the_job_s_selector_is_refused_and_the_quota_given_back() -> (
    None
):
    """Kueue's podset.Merge refuses a key set both ways; its job reconciler then marks the
    Workload Finished (FailedToStart): no pod starts, the quota goes back."""
    out = kstep(FineTuneJobStatus(), [], _admitted_for(_on_demand()), spec=_on_demand())
    assert created(out) == [] and out.status.phase == "Failed"
    assert cond(out.status, "Failed") == ("True", "FailedToStart")
    message = _message(out, "Failed")
    for part in (
        "ResourceFlavor spot",
        "cloud.example.com/pool=spot",
        "cloud.example.com/pool=on-demand",
    ):
        assert part in message
    patch = out.actions.workload_status
    assert patch is not None
    finished = next(c for c in patch["status"]["conditions"] if c["type"] == "Finished")
    assert (finished["status"], finished["reason"]) == ("True", "FailedToStart")
    assert "cloud.example.com/pool" in finished["message"]
    # Finished: nothing more written; with or without its admission left, the job says why.
    done = _admitted_for(_on_demand())
    done["status"]["conditions"].append(
        _cond("Finished", "True", "FailedToStart", finished["message"])
    )
    again = kstep(out.status, [], done, 5, spec=_on_demand())
    assert again.actions.workload_status is None and created(again) == []
    assert cond(again.status, "Failed") == ("True", "FailedToStart")
    del done["status"]["admission"]
    bare = kstep(out.status, [], done, 10, spec=_on_demand())
    assert cond(bare.status, "Failed") == ("True", "FailedToStart") and created(bare) == []


def test_a_flavor_label_agreeing_with_the_job_s_selector_starts_it() -> None:
    raw = quickstart_raw()
    raw["resources"]["nodeSelector"] = {"cloud.example.com/pool": "spot"}
    out = kstep(FineTuneJobStatus(), [], _admitted_for(raw), spec=raw)
    assert created(out) == list(ALL)
    worker = next(p for p in out.actions.create if p["metadata"]["name"] == "qs-worker-0")
    assert worker["spec"]["nodeSelector"]["cloud.example.com/pool"] == "spot"


def test_an_admission_check_update_contradicting_the_flavor_is_refused() -> None:
    checks = [{"name": "prov", "state": "Ready", "message": "", "lastTransitionTime": "2026-01-01T12:00:00Z",
               "podSetUpdates": [{"name": "workers", "nodeSelector": {"cloud.example.com/pool": "reserved"}}]}]  # fmt: skip
    out = kstep(FineTuneJobStatus(), [], admitted(2, checks=checks))
    assert created(out) == [] and cond(out.status, "Failed") == ("True", "FailedToStart")
    message = _message(out, "Failed")
    assert "admission check prov" in message and "ResourceFlavor spot" in message
    assert "cloud.example.com/pool=reserved" in message


def test_tolerations_are_only_added_never_refused() -> None:
    raw = quickstart_raw()
    raw["resources"]["tolerations"] = [
        {"key": "spot", "operator": "Equal", "value": "x", "effect": "NoExecute"}
    ]
    out = kstep(FineTuneJobStatus(), [], _admitted_for(raw), spec=raw)
    worker = next(p for p in out.actions.create if p["metadata"]["name"] == "qs-worker-0")
    assert raw["resources"]["tolerations"][0] in worker["spec"]["tolerations"]
    assert SPOT["spec"]["tolerations"][0] in worker["spec"]["tolerations"]  # type: ignore[index]


def test_workers_started_before_a_flavor_changed_keep_running_but_none_is_added() -> None:
    out = kstep(
        FineTuneJobStatus(),
        running("qs-rdzv", "qs-worker-0"),
        _admitted_for(_on_demand()),
        spec=_on_demand(),
    )
    assert deleted(out) == [] and created(out) == []
    assert "cannot be applied" in _message(out, "WorkersReady")


# ---------------------------------------------------------------- the resource-in-use finalizer

IN_USE = "kueue.x-k8s.io/resource-in-use"


def _finished(wl: dict[str, Any]) -> dict[str, Any]:
    wl["status"]["conditions"].append(_cond("Finished", "True", "Succeeded"))
    return wl


def _deleting(wl: dict[str, Any]) -> dict[str, Any]:
    wl["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    return wl


def _drops_finalizer(out: Outcome) -> bool:
    patch = out.actions.workload_finalizer
    if patch is None:
        return False
    assert patch["metadata"]["resourceVersion"] == "7"  # the list is replaced whole
    return IN_USE not in patch["metadata"]["finalizers"]


def test_the_workload_is_created_with_kueue_s_resource_in_use_finalizer() -> None:
    out = kstep(FineTuneJobStatus(), [], None)
    assert out.actions.workload is not None
    assert out.actions.workload["metadata"]["finalizers"] == [IN_USE]


def test_the_finalizer_comes_off_once_the_workload_finished_and_no_pod_runs() -> None:
    from tests.operator.test_reconcile import pod

    done = [
        pod("qs-worker-0", "Succeeded", exit_code=0),
        pod("qs-worker-1", "Succeeded", exit_code=0),
    ]
    marking = kstep(FineTuneJobStatus(), done, admitted(2))
    assert marking.actions.workload_status is not None  # Finished is written first
    assert not _drops_finalizer(marking)
    # Read back Finished: finished workers hold nothing; the store still going away does.
    store = pod("qs-rdzv", "Running", ready=True, deleting=True)
    assert not _drops_finalizer(kstep(marking.status, [*done, store], _finished(admitted(2)), 5))
    assert _drops_finalizer(kstep(marking.status, done, _finished(admitted(2)), 10))
    gone = _finished(admitted(2))
    gone["metadata"]["finalizers"] = []
    assert kstep(marking.status, done, gone, 15).actions.workload_finalizer is None


def test_a_workload_being_deleted_stops_the_workers_then_drops_its_finalizer() -> None:
    """Kueue's job reconciler stops the job of a Workload marked for deletion and removes the
    finalizer; the operator removes it once the pods are gone (the quota counted till then)."""
    live = kstep(FineTuneJobStatus(), running(*ALL), admitted(2)).status
    stop = kstep(live, running(*ALL), _deleting(admitted(2)), 5)
    assert sorted(deleted(stop)) == sorted(ALL) and not _drops_finalizer(stop)
    assert stop.actions.workload is None and stop.actions.remove == ()
    assert "being deleted" in _message(stop)
    gone = kstep(stop.status, [], _deleting(admitted(2)), 10)
    assert _drops_finalizer(gone) and gone.actions.workload_status is None
    assert created(gone) == [] and gone.actions.workload is None
    # Once it is gone, a new one is created (and admitted anew before any pod).
    anew = kstep(gone.status, [], None, 15)
    assert anew.actions.workload is not None and created(anew) == []


def test_leaving_kueue_deletes_the_workload_then_drops_its_finalizer() -> None:
    leaving = read_left_queue_state(_deleting(admitted(2)), JOB.uid)
    out = _pass(FineTuneJobStatus(), [], leaving)
    assert out.actions.remove == () and _drops_finalizer(out)  # deleted already


def test_a_finished_job_whose_label_is_removed_still_drops_the_finalizer() -> None:
    from tests.operator.test_reconcile import pod

    done = [
        pod("qs-worker-0", "Succeeded", exit_code=0),
        pod("qs-worker-1", "Succeeded", exit_code=0),
    ]
    status = kstep(FineTuneJobStatus(), done, admitted(2)).status
    leaving = read_left_queue_state(_finished(admitted(2)), JOB.uid)
    assert leaving is not None and leaving.finished
    out = _pass(status, done, leaving, 5)
    assert out.status.phase == "Succeeded" and _drops_finalizer(out)
    assert out.actions.remove == () and created(out) == []


def test_failed_to_start_advises_what_the_api_server_lets_the_user_do() -> None:
    """The spec is immutable (the CRD's transition rule refuses a nodeSelector edit), so the
    message must not ask for one: a new job (delete and apply again), or the flavor fixed and
    the Workload deleted. The latter queues the job again, as Kueue recreates the Workload of
    a job it refused to start."""
    from finetune_operator.api.crd_rules import IMMUTABLE_SPEC_MESSAGE, MUTABLE_SPEC_FIELDS

    assert "resources" not in MUTABLE_SPEC_FIELDS and "immutable" in IMMUTABLE_SPEC_MESSAGE
    out = kstep(FineTuneJobStatus(), [], _admitted_for(_on_demand()), spec=_on_demand())
    message = _message(out, "Failed")
    assert "Change the job's spec.resources.nodeSelector" not in message
    assert "delete the job and apply it again" in message and "delete the Workload" in message
    # The flavor fixed and the Workload deleted: queued again, a new Workload, no longer Failed.
    requeued = kstep(out.status, [], None, 5, spec=_on_demand())
    assert requeued.actions.workload is not None and created(requeued) == []
    assert cond(requeued.status, "Failed")[0] != "True" and requeued.status.phase != "Failed"


def _without_finalizer(wl: dict[str, Any], *others: str) -> dict[str, Any]:
    """As the operator wrote its Workloads before it set Kueue's finalizer at creation."""
    wl["metadata"]["finalizers"] = list(others)
    return wl


def test_a_workload_holding_quota_without_the_finalizer_gets_it() -> None:
    live = kstep(FineTuneJobStatus(), running(*ALL), admitted(2)).status
    out = kstep(live, running(*ALL), _without_finalizer(admitted(2), "example.com/keep"), 5)
    patch = out.actions.workload_finalizer
    assert patch is not None and patch["metadata"]["resourceVersion"] == "7"
    assert patch["metadata"]["finalizers"] == ["example.com/keep", IN_USE]  # others kept
    assert deleted(out) == [] and out.status.phase == "Running"
    # Evicted, its workers stopping: still holding quota, still adopted.
    evicted = admitted(2)
    evicted["status"]["conditions"].append(_cond("Evicted", "True", "Preempted", "preempted"))
    stopping = kstep(live, running(*ALL), _without_finalizer(evicted), 10)
    assert stopping.actions.workload_finalizer is not None


@pytest.mark.parametrize("case", ["waiting", "finished", "deleting", "job-over"])
def test_a_workload_not_holding_quota_or_going_is_not_given_the_finalizer(case: str) -> None:
    from tests.operator.test_reconcile import pod

    pods = running(*ALL)
    wl = _without_finalizer(admitted(2))
    if case == "waiting":
        wl = _without_finalizer(workload(_cond("QuotaReserved", "False", "Pending")))
        pods = []
    elif case == "finished":
        wl = _finished(wl)
        pods = []
    elif case == "deleting":
        wl = _deleting(wl)
    else:  # Finished is being written this pass: the quota goes with it
        pods = [pod("qs-worker-0", "Succeeded", exit_code=0), pod("qs-worker-1", "Succeeded", exit_code=0)]  # fmt: skip
    out = kstep(FineTuneJobStatus(), pods, wl)
    assert out.actions.workload_finalizer is None
