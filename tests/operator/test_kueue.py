"""Kueue: the Workload the operator builds (against Kueue's published schema), reading an
admission (count, flavor placement, eviction), and what a reconcile pass does in each state."""

from __future__ import annotations

import copy
import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from finetune_local.kueue import kueue_crds
from finetune_operator.api.schema_validation import CustomResourceSchema
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import Outcome, PodView, reconcile_job
from finetune_operator.reconcile.admission import QueueState, read_queue_state
from finetune_operator.resources import Owner, build_worker_pod
from finetune_operator.resources.workload import (
    POD_SET,
    Placement,
    PriorityRef,
    build_workload,
    place_worker,
    priority_ref,
    queue_name_of,
    worker_template,
)
from tests.operator.factories import make_plan, quickstart_raw
from tests.operator.test_reconcile import ALL, JOB, T0, cond, created, deleted, pod, running

SCHEMA = Path(__file__).resolve().parents[1] / "data" / "kueue" / "workload-v1beta2-spec.yaml"
QUEUE = "team-a-gpus"
SPOT = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "spot"},
        "spec": {"nodeLabels": {"cloud.example.com/pool": "spot"},
                 "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}}  # fmt: skip


def _upstream_schema() -> CustomResourceSchema:
    spec = yaml.safe_load(SCHEMA.read_text())
    return CustomResourceSchema({"type": "object", "properties": {"spec": spec}})


def _local_schema() -> CustomResourceSchema:
    crd = kueue_crds()[0]
    return CustomResourceSchema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def _cond(ctype: str, status: str, reason: str = "R", message: str = "") -> dict[str, Any]:
    return {"type": ctype, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T12:00:00Z"}  # fmt: skip


def workload(*conds: dict[str, Any], count: int | None = None, flavor: str | None = "spot",
             checks: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """The job's Workload as Kueue would leave it: admitted at `count` with `flavor`, or not."""
    from finetune_operator.api.spec import FineTuneJobSpec

    spec = FineTuneJobSpec.model_validate(quickstart_raw())
    wl = build_workload(JOB.owner, spec, make_plan(2), QUEUE)
    wl["metadata"].update(resourceVersion="7", generation=1)
    status: dict[str, Any] = {"conditions": list(conds)}
    if count is not None:
        assignment: dict[str, Any] = {"name": POD_SET, "count": count}
        if flavor:
            assignment["flavors"] = {"cpu": flavor, "memory": flavor}
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [assignment]}
    if checks:
        status["admissionChecks"] = checks
    wl["status"] = status
    return wl


ADMITTED = (_cond("QuotaReserved", "True"), _cond("Admitted", "True"))


def admitted(count: int = 2, **kw: Any) -> dict[str, Any]:
    return workload(*ADMITTED, count=count, **kw)


# ---------------------------------------------------------------- the Workload


@pytest.mark.parametrize(("min_nodes", "max_nodes", "nodes", "min_count"),
                         [(1, 2, 2, 1), (2, 2, 2, None), (1, 4, 3, 1)],
                         ids=["elastic", "fixed", "elastic-planned-below-max"])  # fmt: skip
def test_workload_asks_for_the_planned_nodes_and_accepts_down_to_min_nodes(
    owner: Owner, min_nodes: int, max_nodes: int, nodes: int, min_count: int | None
) -> None:
    from finetune_operator.api.spec import FineTuneJobSpec

    raw = quickstart_raw()
    raw["resources"].update(minNodes=min_nodes, maxNodes=max_nodes)
    spec = FineTuneJobSpec.model_validate(raw)
    wl = build_workload(owner, spec, make_plan(nodes), QUEUE)
    (pod_set,) = wl["spec"]["podSets"]
    assert pod_set["count"] == nodes and pod_set.get("minCount") == min_count
    assert wl["spec"]["queueName"] == QUEUE and wl["spec"]["active"] is True
    assert wl["metadata"]["ownerReferences"][0]["uid"] == owner.uid  # deleted with the job
    for schema in (_upstream_schema(), _local_schema()):
        assert schema.validate(wl) == []
        assert schema.unknown_fields(wl) == []


def test_workload_template_requests_what_the_worker_pods_request(
    owner: Owner, gpu8_spec: Any
) -> None:
    plan = make_plan(2, 8)
    template = worker_template(owner, gpu8_spec, plan)
    for index in range(plan.nodes):
        worker = build_worker_pod(owner, gpu8_spec, plan, index)
        assert (
            template["spec"]["containers"][0]["resources"]
            == worker["spec"]["containers"][0]["resources"]
        )
        assert template["spec"]["nodeSelector"] == worker["spec"]["nodeSelector"]
    assert template["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "8"
    # A PodTemplateSpec's metadata in a Workload may carry only labels and annotations.
    assert set(template["metadata"]) <= {"labels", "annotations"}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "t"}, "spec": template["spec"]}
    kubernetes_validate.validate(pod, "1.32", strict=True)


def test_upstream_schema_refuses_a_min_count_above_count(
    owner: Owner, quickstart_spec: Any
) -> None:
    wl = build_workload(owner, quickstart_spec, make_plan(2), QUEUE)
    bad = copy.deepcopy(wl)
    bad["spec"]["podSets"][0]["minCount"] = 3
    assert any("minCount" in msg for _, msg in _upstream_schema().validate(bad))
    assert any("minCount" in msg for _, msg in _local_schema().validate(bad))


def test_suspended_job_has_an_inactive_workload(owner: Owner) -> None:
    from finetune_operator.api.spec import FineTuneJobSpec

    spec = FineTuneJobSpec.model_validate(quickstart_raw() | {"suspend": True})
    assert build_workload(owner, spec, make_plan(2), QUEUE)["spec"]["active"] is False


@pytest.mark.parametrize(("labels", "queue"), [
    ({"kueue.x-k8s.io/queue-name": "q"}, "q"), ({"kueue.x-k8s.io/queue-name": " "}, None),
    ({"other": "x"}, None), (None, None)], ids=["set", "blank", "other", "none"])  # fmt: skip
def test_opt_in_is_the_queue_name_label(labels: dict[str, str] | None, queue: str | None) -> None:
    assert queue_name_of(labels) == queue


def test_placement_adds_flavor_selector_and_tolerations_to_the_job_s_own(
    owner: Owner, gpu8_spec: Any
) -> None:
    worker = build_worker_pod(owner, gpu8_spec, make_plan(2, 8), 0)
    toleration = {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}
    placed = place_worker(
        copy.deepcopy(worker), Placement({"pool": "spot"}, (toleration,), {"l": "1"})
    )
    assert placed["spec"]["nodeSelector"] == {**worker["spec"]["nodeSelector"], "pool": "spot"}
    assert placed["spec"]["tolerations"] == [*worker["spec"]["tolerations"], toleration]
    assert placed["metadata"]["labels"]["l"] == "1"
    assert place_worker(copy.deepcopy(worker), Placement()) == worker


# ---------------------------------------------------------------- reading the admission


@pytest.mark.parametrize(("wl", "admitted_count", "message_part"), [
    (None, None, "creating its Workload"),
    (workload(_cond("QuotaReserved", "False", "Pending", "couldn't assign flavors to pod set workers: "
                    "insufficient unused quota for nvidia.com/gpu in flavor spot, 8 more needed")),
     None, "insufficient unused quota for nvidia.com/gpu"),
    (workload(_cond("QuotaReserved", "True"), _cond("Admitted", "False", "NoChecks", "Waiting for AdmissionChecks"),
              count=2), None, "Waiting for AdmissionChecks"),
    (admitted(1), 1, ""),
    (workload(*ADMITTED, _cond("Evicted", "True", "Preempted", "Preempted to accommodate a higher priority Workload"),
              count=2), None, "Preempted: Preempted to accommodate"),
], ids=["no-workload", "no-quota", "checks-pending", "admitted-partially", "evicted"])  # fmt: skip
def test_read_queue_state(
    wl: dict[str, Any] | None, admitted_count: int | None, message_part: str
) -> None:
    state = read_queue_state(QUEUE, wl, {"spot": SPOT})
    assert state.admitted_count == admitted_count
    assert state.admitted is (admitted_count is not None)
    if admitted_count is None:
        assert message_part in state.describe_wait() and QUEUE in state.describe_wait()


def test_admission_reads_the_flavor_and_admission_check_updates() -> None:
    checks = [{"name": "prov", "state": "Ready", "message": "", "lastTransitionTime": "2026-01-01T12:00:00Z",
               "podSetUpdates": [{"name": POD_SET, "nodeSelector": {"zone": "z1"}, "annotations": {"a": "b"}}]}]  # fmt: skip
    state = read_queue_state(QUEUE, admitted(2, checks=checks), {"spot": SPOT})
    assert state.placement.node_selector == {"cloud.example.com/pool": "spot", "zone": "z1"}
    assert state.placement.tolerations == tuple(SPOT["spec"]["tolerations"])  # type: ignore[index]
    assert state.placement.annotations == {"a": "b"}


def test_an_admission_to_a_flavor_that_cannot_be_read_waits() -> None:
    state = read_queue_state(QUEUE, admitted(2), {})
    assert not state.admitted and state.missing_flavors == ("spot",)
    assert "ResourceFlavor spot cannot be read" in state.describe_wait()


def test_an_admission_without_a_count_is_the_pod_set_s_count() -> None:
    wl = admitted(2)
    del wl["status"]["admission"]["podSetAssignments"][0]["count"]
    assert read_queue_state(QUEUE, wl, {"spot": SPOT}).admitted_count == 2


# ---------------------------------------------------------------- the reconcile pass


def kstep(status: FineTuneJobStatus, pods: list[PodView], wl: dict[str, Any] | None, seconds: float = 0,
          *, spec: dict[str, Any] | None = None, unreadable: str = "",
          flavors: dict[str, Any] | None = None) -> Outcome:  # fmt: skip
    queue = read_queue_state(
        QUEUE, wl, {"spot": SPOT} if flavors is None else flavors, unreadable=unreadable
    )
    return reconcile_job(JOB, spec or quickstart_raw(), status, pods, T0 + timedelta(seconds=seconds),
                         planner=lambda _: make_plan(2), ensured_generation=1, queue=queue)  # fmt: skip


def test_queued_job_creates_its_workload_and_no_pod_until_admitted() -> None:
    first = kstep(FineTuneJobStatus(), [], None)
    assert (
        first.actions.workload is not None and first.actions.workload["spec"]["queueName"] == QUEUE
    )
    assert created(first) == [] and first.status.phase == "Pending"
    assert cond(first.status, "Succeeded") == ("Unknown", "Queued")
    message = "couldn't assign flavors to pod set workers: insufficient quota for nvidia.com/gpu"
    waiting = kstep(
        first.status, [], workload(_cond("QuotaReserved", "False", "Pending", message)), 5
    )
    assert waiting.actions.empty  # the Workload exists: nothing to write
    succeeded = next(c for c in waiting.status.conditions if c.type == "Succeeded")
    assert succeeded.message == f"queued in LocalQueue {QUEUE}: {message}"
    go = kstep(waiting.status, [], admitted(1), 10)
    assert created(go) == ["qs-rdzv", "qs-worker-0"]  # the admitted count, not the planned 2
    worker = next(p for p in go.actions.create if p["metadata"]["name"] == "qs-worker-0")
    assert worker["spec"]["nodeSelector"]["cloud.example.com/pool"] == "spot"
    assert SPOT["spec"]["tolerations"][0] in worker["spec"]["tolerations"]  # type: ignore[index]
    up = kstep(go.status, running("qs-rdzv", "qs-worker-0"), admitted(1), 15)
    assert up.status.phase == "Running" and cond(up.status, "WorkersReady")[0] == "True"


def test_eviction_stops_the_workers_without_counting_and_gives_the_quota_back() -> None:
    live = kstep(FineTuneJobStatus(), running(*ALL), admitted(2)).status
    evicted = workload(
        *ADMITTED, _cond("Evicted", "True", "Preempted", "Preempted to accommodate wl-b"), count=2
    )
    stop = kstep(live, running(*ALL), evicted, 5)
    assert sorted(deleted(stop)) == sorted(ALL) and created(stop) == []
    assert all(d.reason == "Evicted" for d in stop.actions.delete)
    assert stop.actions.workload_status is None  # not while its pods still run
    assert (
        cond(stop.status, "Succeeded") == ("Unknown", "Evicted") and stop.status.phase == "Pending"
    )
    assert any(e.reason == "Evicted" for e in stop.events)
    # The trainers exit 143 on SIGTERM: not a failure, nothing spent.
    dying = [pod("qs-worker-0", "Failed", exit_code=143, deleting=True)]
    quiet = kstep(stop.status, dying, evicted, 8)
    assert quiet.status.restarts == 0 and quiet.actions.workload_status is None
    gone = kstep(quiet.status, [], evicted, 12)
    patch = gone.actions.workload_status
    assert patch is not None and gone.actions.workload_name == "qs"
    assert patch["status"]["admission"] is None and patch["metadata"] == {"resourceVersion": "7"}
    reserved = {c["type"]: c for c in patch["status"]["conditions"]}
    assert (
        reserved["QuotaReserved"]["status"] == "False" and reserved["Admitted"]["status"] == "False"
    )
    assert reserved["Evicted"]["status"] == "True"  # Kueue's own, kept
    # Requeued as Kueue's job reconciler sets it: True after a preemption, with its words.
    assert (reserved["Requeued"]["status"], reserved["Requeued"]["reason"]) == ("True", "Preempted")
    assert reserved["Requeued"]["message"] == "Preempted to accommodate wl-b"
    # Kueue admits it again (its Evicted condition goes False): everything is created again.
    again = workload(*ADMITTED, _cond("Evicted", "False", "QuotaReserved"), count=2)
    back = kstep(gone.status, [], again, 30)
    assert created(back) == list(ALL) and back.status.restarts == 0


def test_success_and_failure_mark_the_workload_finished() -> None:
    done = [
        pod("qs-worker-0", "Succeeded", exit_code=0),
        pod("qs-worker-1", "Succeeded", exit_code=0),
    ]
    out = kstep(FineTuneJobStatus(), done, admitted(2))
    patch = out.actions.workload_status
    assert out.status.phase == "Succeeded" and patch is not None
    finished = next(c for c in patch["status"]["conditions"] if c["type"] == "Finished")
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")
    already = admitted(2)
    already["status"]["conditions"].append(_cond("Finished", "True", "Succeeded"))
    assert kstep(out.status, done, already, 5).actions.workload_status is None


def test_suspend_deactivates_the_workload() -> None:
    live = kstep(FineTuneJobStatus(), running(*ALL), admitted(2)).status
    suspended = quickstart_raw() | {"suspend": True}
    out = kstep(live, running(*ALL), admitted(2), 5, spec=suspended)
    assert sorted(deleted(out)) == sorted(ALL) and out.status.phase == "Suspended"
    assert out.actions.workload is not None and out.actions.workload["spec"]["active"] is False


def test_a_job_without_the_label_has_no_workload() -> None:
    out = reconcile_job(
        JOB, quickstart_raw(), FineTuneJobStatus(), [], T0, planner=lambda _: make_plan(2)
    )
    assert out.actions.workload is None and out.actions.workload_status is None
    assert created(out) == list(ALL)


def test_queue_state_compares_without_the_raw_object() -> None:
    assert QueueState(QUEUE, raw={"a": 1}) == QueueState(QUEUE)


# ---------------------------------------------------------------- priority


@pytest.mark.parametrize(("labels", "pods_class", "expected"), [
    ({"kueue.x-k8s.io/priority-class": "urgent"}, "training", ("kueue.x-k8s.io", "WorkloadPriorityClass", "urgent")),
    (None, "training", ("scheduling.k8s.io", "PriorityClass", "training")),
    (None, None, None),
], ids=["workload-priority-class-label", "pods-priority-class", "none"])  # fmt: skip
def test_priority_class_of_the_workload(labels: dict[str, str] | None, pods_class: str | None,
                                        expected: tuple[str, str, str] | None) -> None:  # fmt: skip
    ref = priority_ref(labels, pods_class)
    assert (None if ref is None else (ref.group, ref.kind, ref.name)) == expected


def test_workload_carries_its_priority_class_and_value(owner: Owner, quickstart_spec: Any) -> None:
    ref = PriorityRef("scheduling.k8s.io", "PriorityClass", "training")
    wl = build_workload(owner, quickstart_spec, make_plan(2), QUEUE, (ref, 1000))
    assert wl["spec"]["priorityClassRef"] == {
        "group": "scheduling.k8s.io",
        "kind": "PriorityClass",
        "name": "training",
    }
    assert wl["spec"]["priority"] == 1000
    assert _upstream_schema().validate(wl) == []
    # Kueue refuses a class without its value: why the operator resolves it first.
    del wl["spec"]["priority"]
    assert any("priority should not be nil" in msg for _, msg in _upstream_schema().validate(wl))


def test_a_priority_class_that_cannot_be_read_holds_the_workload_back() -> None:
    problem = "PriorityClass training (HTTP 404 Not Found) does not exist"
    queue = read_queue_state(QUEUE, None, {}, priority_problem=problem)
    out = reconcile_job(JOB, quickstart_raw(), FineTuneJobStatus(), [], T0,
                        planner=lambda _: make_plan(2), queue=queue)  # fmt: skip
    assert out.actions.workload is None and created(out) == []
    assert problem in next(c for c in out.status.conditions if c.type == "Succeeded").message
    ref = PriorityRef("scheduling.k8s.io", "PriorityClass", "training")
    ok = read_queue_state(QUEUE, None, {}, priority=(ref, 7))
    out = reconcile_job(JOB, quickstart_raw(), FineTuneJobStatus(), [], T0,
                        planner=lambda _: make_plan(2), queue=ok)  # fmt: skip
    assert out.actions.workload is not None and out.actions.workload["spec"]["priority"] == 7


def test_a_workload_of_another_owner_is_not_this_job_s() -> None:
    stale = admitted(2)
    stale["metadata"]["ownerReferences"][0]["uid"] = "an-older-job"
    queue = read_queue_state(QUEUE, stale, {"spot": SPOT}, owner_uid=JOB.uid)
    assert queue.foreign and not queue.admitted
    out = reconcile_job(JOB, quickstart_raw(), FineTuneJobStatus(), [], T0,
                        planner=lambda _: make_plan(2), queue=queue)  # fmt: skip
    assert (
        created(out) == [] and out.actions.workload is None and out.actions.workload_status is None
    )
    assert (
        "belongs to another owner"
        in next(c for c in out.status.conditions if c.type == "Succeeded").message
    )
    assert read_queue_state(QUEUE, admitted(2), {"spot": SPOT}, owner_uid=JOB.uid).admitted


def test_pods_ready_is_kept_on_the_workload_for_wait_for_pods_ready() -> None:
    def ready_cond(out: Outcome) -> tuple[str, str] | None:
        patch = out.actions.workload_status
        if patch is None:
            return None
        c = next(c for c in patch["status"]["conditions"] if c["type"] == "PodsReady")
        return c["status"], c["reason"]

    starting = kstep(FineTuneJobStatus(), [], admitted(2))
    assert ready_cond(starting) == ("False", "WaitForStart")
    up = kstep(starting.status, running(*ALL), admitted(2), 5)
    assert ready_cond(up) == ("True", "Started")
    marked = admitted(2)
    marked["status"]["conditions"].append(_cond("PodsReady", "True", "Started"))
    assert kstep(up.status, running(*ALL), marked, 8).actions.workload_status is None  # unchanged
    lost = kstep(up.status, running("qs-rdzv", "qs-worker-0"), marked, 10)
    assert ready_cond(lost) == ("False", "WaitForRecovery")


def test_both_priority_sources_validate_upstream(owner: Owner, quickstart_spec: Any) -> None:
    for ref in (
        priority_ref({"kueue.x-k8s.io/priority-class": "urgent"}, None),
        priority_ref(None, "training"),
    ):
        assert ref is not None
        assert (
            _upstream_schema().validate(
                build_workload(owner, quickstart_spec, make_plan(2), QUEUE, (ref, 5))
            )
            == []
        )
    wrong = PriorityRef("kueue.x-k8s.io", "PriorityClass", "urgent")
    errors = _upstream_schema().validate(
        build_workload(owner, quickstart_spec, make_plan(2), QUEUE, (wrong, 5))
    )
    assert any("only the WorkloadPriorityClass kind" in msg for _, msg in errors)


def _pods_ready_of(out: Outcome) -> tuple[str, str] | None:
    patch = out.actions.workload_status
    conds = {c["type"]: c for c in (patch or {}).get("status", {}).get("conditions", [])}
    c = conds.get("PodsReady")
    return None if c is None else (c["status"], c["reason"])


def test_an_eviction_takes_pods_ready_back_with_the_quota() -> None:
    """Kueue's job reconciler writes PodsReady False (WaitForStart) for a Workload no longer
    admitted; left True, the re-admitted job would count as ready before any pod is, and its
    start would be timed as a recovery."""
    was_running = (*ADMITTED, _cond("PodsReady", "True", "Started"))
    evicted = workload(*was_running, _cond("Evicted", "True", "Preempted", "Preempted"), count=2)
    live = kstep(FineTuneJobStatus(), running(*ALL), admitted(2)).status
    gone = kstep(live, [], evicted, 12)
    assert _pods_ready_of(gone) == ("False", "WaitForStart")
    # Admission taken away by someone else (no eviction pending here): the same.
    requeued = workload(
        _cond("QuotaReserved", "False", "Pending"), _cond("PodsReady", "True", "Started")
    )
    assert _pods_ready_of(kstep(live, [], requeued, 14)) == ("False", "WaitForStart")
    # Re-admitted and starting: False already, nothing written; once ready, Started again.
    again = workload(*ADMITTED, _cond("Evicted", "False", "QuotaReserved"),
                     _cond("PodsReady", "False", "WaitForStart"), count=2)  # fmt: skip
    starting = kstep(gone.status, [], again, 30)
    assert created(starting) == list(ALL) and starting.actions.workload_status is None
    assert _pods_ready_of(kstep(starting.status, running(*ALL), again, 40)) == ("True", "Started")


def test_pods_ready_after_waiting_for_recovery_is_recovered() -> None:
    recovering = workload(*ADMITTED, _cond("PodsReady", "False", "WaitForRecovery"), count=2)
    out = kstep(FineTuneJobStatus(), running(*ALL), recovering)
    assert _pods_ready_of(out) == ("True", "Recovered")


def _asking_for_other_pods(wl: dict[str, Any]) -> dict[str, Any]:
    """`wl` as written for an earlier spec of the job: other requests per worker."""
    container = wl["spec"]["podSets"][0]["template"]["spec"]["containers"][0]
    container["resources"] = {"requests": {"cpu": "64", "memory": "512Gi"}}
    return wl


def test_a_workload_written_for_an_earlier_spec_is_rewritten_while_it_holds_no_quota() -> None:
    """Kueue admits the quota its Workload asks for: one left as written before the job was
    edited would be admitted for pods the operator does not create."""
    pending = _asking_for_other_pods(workload(_cond("QuotaReserved", "False", "Pending")))
    out = kstep(FineTuneJobStatus(), [], pending)
    assert out.actions.workload is not None and out.actions.workload_rewrite
    rewritten = out.actions.workload["spec"]["podSets"][0]["template"]["spec"]["containers"][0]
    assert rewritten["resources"] != {"requests": {"cpu": "64", "memory": "512Gi"}}
    assert created(out) == [] and "changed since its Workload was written" in (
        next(c for c in out.status.conditions if c.type == "Succeeded").message
    )
    # As written for this spec: nothing to rewrite.
    same = kstep(out.status, [], workload(_cond("QuotaReserved", "False", "Pending")), 5)
    assert same.actions.workload is None and not same.actions.workload_rewrite


def test_an_admitted_workload_for_an_earlier_spec_stops_the_workers_and_is_replaced() -> None:
    live = kstep(FineTuneJobStatus(), running(*ALL), admitted(2)).status
    stale = _asking_for_other_pods(admitted(2))
    stop = kstep(live, running(*ALL), stale, 5)
    assert sorted(deleted(stop)) == sorted(ALL) and created(stop) == []
    assert (
        stop.actions.workload is None and stop.actions.remove == ()
    )  # its quota kept while pods run
    gone = kstep(stop.status, [], stale, 10)
    assert [(r.kind, r.name) for r in gone.actions.remove] == [("Workload", "qs")]
    assert created(gone) == [] and gone.actions.workload is None
    # The next pass finds none and creates it as the job now is.
    anew = kstep(gone.status, [], None, 15)
    assert (
        anew.actions.workload is not None
        and anew.actions.workload["spec"]["podSets"][0]["count"] == 2
    )


def test_a_min_count_kueue_dropped_is_not_an_edit_of_the_job() -> None:
    """Kueue's webhook removes minCount when its PartialAdmission gate is off: the Workload
    still asks for the job's pods, and must not be replaced (nor its workers stopped)."""
    no_partial = admitted(2)
    del no_partial["spec"]["podSets"][0]["minCount"]
    out = kstep(FineTuneJobStatus(), running(*ALL), no_partial)
    assert deleted(out) == [] and out.actions.remove == () and out.actions.workload is None


def test_a_changed_queue_label_moves_the_workload_until_it_holds_quota() -> None:
    pending = workload(_cond("QuotaReserved", "False", "Pending"))
    moved = read_queue_state("team-b", pending, {})
    out = reconcile_job(JOB, quickstart_raw(), FineTuneJobStatus(), [], T0,
                        planner=lambda _: make_plan(2), queue=moved)  # fmt: skip
    assert out.actions.workload is not None and out.actions.workload_rewrite
    assert out.actions.workload["spec"]["queueName"] == "team-b"
    # Admitted by the old queue: it runs on there (Kueue forbids moving a reserved Workload).
    running_there = read_queue_state("team-b", admitted(2), {"spot": SPOT})
    out = reconcile_job(JOB, quickstart_raw(), FineTuneJobStatus(), running(*ALL), T0,
                        planner=lambda _: make_plan(2), queue=running_there)  # fmt: skip
    assert out.actions.workload is None and deleted(out) == []


NOT_SERVED = "Workload qs (HTTP 404 Not Found): the API server does not serve workloads.kueue.x-k8s.io/v1beta2"


@pytest.mark.parametrize(("wl", "unreadable", "flavors"),
                         [(None, NOT_SERVED, None), (None, "Workload qs (HTTP 403 Forbidden): may not", None),
                          ("admitted", "", {})],
                         ids=["crd-gone", "no-permission", "flavor-unreadable"])  # fmt: skip
def test_an_admission_that_cannot_be_read_keeps_the_running_workers(
    wl: str | None, unreadable: str, flavors: dict[str, Any] | None
) -> None:
    live = kstep(FineTuneJobStatus(), running(*ALL), admitted(2)).status
    workload_now = admitted(2) if wl else None
    out = kstep(live, running(*ALL), workload_now, 5, unreadable=unreadable, flavors=flavors)
    assert deleted(out) == [] and created(out) == [] and out.actions.workload is None
    assert out.status.phase == "Running"
    ready = next(c for c in out.status.conditions if c.type == "WorkersReady")
    assert (
        "Kueue admission cannot be read" in ready.message
        and "running workers kept" in ready.message
    )
    # A worker lost meanwhile is not replaced (no pod without a known admission).
    one = [*running("qs-rdzv", "qs-worker-0")]
    assert (
        created(kstep(out.status, one, workload_now, 10, unreadable=unreadable, flavors=flavors))
        == []
    )
    # Nothing running: the job waits, and says why.
    idle = kstep(FineTuneJobStatus(), [], workload_now, unreadable=unreadable, flavors=flavors)
    assert created(idle) == [] and idle.status.phase == "Pending"


def test_a_workload_deleted_while_its_crd_is_served_stops_the_workers() -> None:
    """Kueue's semantics: a job whose Workload is gone runs only once a new one is admitted."""
    live = kstep(FineTuneJobStatus(), running(*ALL), admitted(2)).status
    out = kstep(live, running(*ALL), None, 5)
    assert sorted(deleted(out)) == sorted(ALL) and out.actions.workload is not None


def test_a_job_whose_spec_became_invalid_gives_its_quota_back() -> None:
    """Deactivated (as a suspend), not Finished: Kueue evicts it and the quota is released
    once the pods are gone; made valid again, the Workload is reactivated and requeued."""
    live = kstep(FineTuneJobStatus(), running(*ALL), admitted(2)).status
    broken = quickstart_raw()
    broken["training"].pop("maxSteps")
    out = kstep(live, running(*ALL), admitted(2), 5, spec=broken)
    assert cond(out.status, "Failed") == ("True", "InvalidSpec") and sorted(deleted(out)) == sorted(
        ALL
    )
    assert out.actions.workload_deactivate and out.actions.workload_name == "qs"
    inactive = admitted(2)
    inactive["spec"]["active"] = False
    inactive["status"]["conditions"].append(
        _cond("Evicted", "True", "Deactivated", "The workload is deactivated")
    )
    gone = kstep(out.status, [], inactive, 10, spec=broken)
    assert not gone.actions.workload_deactivate  # already inactive
    patch = gone.actions.workload_status
    assert patch is not None and patch["status"]["admission"] is None  # the quota given back
    requeued = next(c for c in patch["status"]["conditions"] if c["type"] == "Requeued")
    assert (requeued["status"], requeued["reason"]) == (
        "False",
        "Deactivated",
    )  # not after a deactivation
    edited = dataclasses.replace(JOB, generation=JOB.generation + 1)  # the spec edited valid again
    fixed = reconcile_job(edited, quickstart_raw(), gone.status, [], T0 + timedelta(seconds=15),
                          planner=lambda _: make_plan(2), queue=read_queue_state(QUEUE, inactive, {"spot": SPOT}))  # fmt: skip
    assert fixed.actions.workload is not None and fixed.actions.workload["spec"]["active"] is True
