"""compute_status / decide_actions: transitions of a job's life, table-driven where it fits."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from finetune_operator.api.constants import (
    COND_FAILED,
    COND_HANG_DETECTED,
    COND_PLANNED,
    COND_STRAGGLER_DETECTED,
    COND_SUCCEEDED,
    COND_WORKERS_READY,
    LABEL_JOB,
    LABEL_ROLE,
    LABEL_WORKER_INDEX,
)
from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.planner.errors import PlanningError
from finetune_operator.reconcile import (
    JobRef,
    Outcome,
    PodView,
    observe_pod,
    reconcile_job,
    status_patch,
)
from finetune_operator.reconcile.conditions import find
from tests.operator.factories import UID, make_plan, quickstart_raw

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
JOB = JobRef(name="qs", namespace="ns", uid=UID, generation=1)


def iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(
    name: str,
    phase: str = "Pending",
    *,
    ready: bool = False,
    exit_code: int | None = None,
    finished: datetime | None = None,
    uid: str | None = None,
    deleting: bool = False,
    node: str = "node-a",
) -> PodView:
    role = "rendezvous" if name.endswith("rdzv") else "worker"
    labels = {LABEL_JOB: "qs", LABEL_ROLE: role}
    if role == "worker":
        labels[LABEL_WORKER_INDEX] = name.rsplit("-", 1)[1]
    status: dict[str, Any] = {"phase": phase, "podIP": "10.0.0.1"}
    status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    if exit_code is not None:
        term = {"exitCode": exit_code, "finishedAt": iso(finished or T0)}
        status["containerStatuses"] = [{"name": "trainer", "state": {"terminated": term}}]
    meta: dict[str, Any] = {"name": name, "uid": uid or f"uid-{name}", "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = iso(T0)
    return observe_pod({"metadata": meta, "spec": {"nodeName": node}, "status": status})


def running(*names: str) -> list[PodView]:
    return [pod(n, "Running", ready=True) for n in names]


ALL = ("qs-rdzv", "qs-worker-0", "qs-worker-1")


def step(
    status: FineTuneJobStatus,
    pods: Sequence[PodView],
    now: datetime,
    *,
    spec: dict[str, Any] | None = None,
    plan: Plan | None = None,
    job: JobRef = JOB,
    ensured: int | None = None,
) -> Outcome:
    raw = spec if spec is not None else quickstart_raw()
    chosen = plan or make_plan(2)
    return reconcile_job(
        job, raw, status, pods, now, planner=lambda _: chosen, ensured_generation=ensured
    )


def cond(status: FineTuneJobStatus, ctype: str) -> tuple[str, str]:
    c = find(status.conditions, ctype)
    assert c is not None, ctype
    return c.status, c.reason


def created(out: Outcome) -> list[str]:
    return [o["metadata"]["name"] for o in out.actions.create]


def deleted(out: Outcome) -> list[str]:
    return [d.name for d in out.actions.delete]


def test_first_visit_sets_every_condition_and_creates_everything() -> None:
    out = step(FineTuneJobStatus(), [], T0)
    s = out.status
    assert [c.type for c in s.conditions] == [
        COND_PLANNED,
        COND_WORKERS_READY,
        COND_SUCCEEDED,
        COND_FAILED,
        COND_STRAGGLER_DETECTED,
        COND_HANG_DETECTED,
    ]
    assert cond(s, COND_PLANNED) == ("True", "PlanFits")
    assert cond(s, COND_SUCCEEDED) == ("Unknown", "Pending")
    assert cond(s, COND_FAILED) == ("False", "Pending")
    assert all(c.observed_generation == 1 for c in s.conditions)
    assert s.phase == "Pending" and s.world_size == 2 and s.start_time == iso(T0)
    assert s.observed_generation == 1 and s.total_steps == 60
    assert [o["kind"] for o in out.actions.ensure] == ["ConfigMap", "Service", "Service"]
    assert created(out) == list(ALL)
    assert {e.reason for e in out.events} >= {"PlanFits", "Pending"}


def test_idempotent_when_everything_exists() -> None:
    first = step(FineTuneJobStatus(), [], T0)
    again = step(first.status, running(*ALL), T0 + timedelta(seconds=2), ensured=1)
    assert again.actions.empty
    # Running now; a third pass with the same world changes nothing at all.
    third = step(again.status, running(*ALL), T0 + timedelta(seconds=4), ensured=1)
    assert third.actions.empty and third.events == ()
    assert third.status == again.status
    assert status_patch(again.status.to_json_dict(), third.status) == {}


def test_pending_to_running() -> None:
    s0 = step(FineTuneJobStatus(), [], T0).status
    pods = [pod("qs-rdzv", "Running", ready=True), pod("qs-worker-0"), pod("qs-worker-1")]
    s1 = step(s0, pods, T0 + timedelta(seconds=1), ensured=1).status
    assert cond(s1, COND_WORKERS_READY) == ("False", "WorkersNotReady")
    assert s1.phase == "Pending"
    out = step(s1, running(*ALL), T0 + timedelta(seconds=5), ensured=1)
    s2 = out.status
    assert cond(s2, COND_WORKERS_READY) == ("True", "AllWorkersReady")
    assert cond(s2, COND_SUCCEEDED) == ("Unknown", "Running")
    assert s2.phase == "Running" and s2.ready_workers == 2
    ready = find(s2.conditions, COND_WORKERS_READY)
    planned_before = find(s1.conditions, COND_PLANNED)
    planned_after = find(s2.conditions, COND_PLANNED)
    assert ready is not None and ready.last_transition_time == iso(T0 + timedelta(seconds=5))
    assert planned_before == planned_after  # untouched condition keeps its transition time
    assert [e.reason for e in out.events] == ["AllWorkersReady", "Running", "Running"]


def test_a_worker_the_kubelet_cannot_start_is_reported() -> None:
    """A worker waiting in CreateContainerConfigError (its Secret is missing) stays Pending:
    the job says which pod and why, and counts nothing as a failure."""
    s0 = step(FineTuneJobStatus(), [], T0).status
    waiting = {"reason": "CreateContainerConfigError", "message": 'secret "s3" not found'}
    raw = {
        "metadata": {
            "name": "qs-worker-0",
            "uid": "uid-qs-worker-0",
            "labels": {LABEL_JOB: "qs", LABEL_ROLE: "worker", LABEL_WORKER_INDEX: "0"},
        },
        "spec": {"nodeName": "node-a"},
        "status": {
            "phase": "Pending",
            "containerStatuses": [{"name": "trainer", "state": {"waiting": waiting}}],
        },
    }
    creating = {
        **raw,
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {"name": "trainer", "state": {"waiting": {"reason": "ContainerCreating"}}}
            ],
        },
    }
    assert observe_pod(creating).blocked is None
    pods = [pod("qs-rdzv", "Running", ready=True), observe_pod(raw), pod("qs-worker-1")]
    s1 = step(s0, pods, T0 + timedelta(seconds=1), ensured=1).status
    for ctype in (COND_WORKERS_READY, COND_SUCCEEDED):
        c = find(s1.conditions, ctype)
        assert c is not None and c.message.endswith(
            '; pod qs-worker-0 cannot start: CreateContainerConfigError: secret "s3" not found'
        ), c.message
    assert s1.phase == "Pending" and s1.restarts == 0


def test_a_worker_no_node_can_take_is_reported() -> None:
    """A worker the scheduler cannot place (no node with the GPUs, taints, quota) stays Pending
    with PodScheduled False/Unschedulable: the job says which pod and the scheduler's reason,
    instead of only '0/1 worker pods ready'."""
    s0 = step(FineTuneJobStatus(), [], T0).status
    unschedulable = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
    }
    raw = {
        "metadata": {
            "name": "qs-worker-0",
            "uid": "uid-qs-worker-0",
            "labels": {LABEL_JOB: "qs", LABEL_ROLE: "worker", LABEL_WORKER_INDEX: "0"},
        },
        "spec": {},
        "status": {"phase": "Pending", "conditions": [unschedulable]},
    }
    assert observe_pod(raw).blocked == (
        "Unschedulable: no node has room for the worker's nvidia.com/gpu "
        "(spec.resources.gpusPerNode): lower it or add node capacity; "
        "scheduler: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    )
    pods = [pod("qs-rdzv", "Running", ready=True), observe_pod(raw), pod("qs-worker-1")]
    s1 = step(s0, pods, T0 + timedelta(seconds=1), ensured=1).status
    c = find(s1.conditions, COND_WORKERS_READY)
    assert c is not None and "pod qs-worker-0 cannot start: Unschedulable: no node has" in c.message
    assert "scheduler: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu." in c.message
    assert s1.phase == "Pending" and s1.restarts == 0
    # A long scheduler message (hundreds of nodes, taints listed) is cut: three such pods
    # still leave the condition message under 1 KiB.
    long = {**unschedulable, "message": "0/500 nodes are available: " + "x" * 2000}
    many = [
        {
            **raw,
            "metadata": {
                **raw["metadata"],
                "name": f"qs-worker-{i}",
                "uid": f"u{i}",
                "labels": {**raw["metadata"]["labels"], LABEL_WORKER_INDEX: str(i)},
            },
            "status": {"phase": "Pending", "conditions": [long]},
        }
        for i in range(4)
    ]
    s2 = step(s0, [pod("qs-rdzv", "Running", ready=True), *map(observe_pod, many)],
              T0 + timedelta(seconds=1), ensured=1).status  # fmt: skip
    c2 = find(s2.conditions, COND_WORKERS_READY)
    assert c2 is not None and "qs-worker-0 cannot start" in c2.message and len(c2.message) < 1024


def test_failure_backoff_replacement_until_budget_exhausted() -> None:
    spec = quickstart_raw()  # maxRestarts 3, backoffSeconds 2
    status = step(FineTuneJobStatus(), running(*ALL), T0, spec=spec).status
    now = T0
    for attempt in range(3):
        failed_at = now + timedelta(seconds=10)
        pods = [*running("qs-rdzv", "qs-worker-0")]
        # Killed from outside (137): its agent did not shut the rendezvous down, the store
        # stays (an agent that exits 1 did: test_budget.py).
        pods.append(
            pod("qs-worker-1", "Failed", exit_code=137, finished=failed_at, uid=f"u{attempt}")
        )
        delay = 2 * 2**attempt
        # Before the backoff elapsed: Restarting, nothing deleted or created.
        early = step(status, pods, failed_at + timedelta(seconds=delay - 0.5), spec=spec, ensured=1)
        assert cond(early.status, COND_SUCCEEDED) == ("Unknown", "Restarting")
        assert early.status.phase == "Restarting" and early.actions.empty
        assert early.status.restarts == attempt
        # Due: the failed pod is deleted (by uid) and counted; recreated on the next pass.
        due = step(status, pods, failed_at + timedelta(seconds=delay), spec=spec, ensured=1)
        assert deleted(due) == ["qs-worker-1"] and due.actions.delete[0].uid == f"u{attempt}"
        assert created(due) == [] and due.status.restarts == attempt + 1
        used = f"replacing it ({attempt + 1} of 3 restarts used)"
        assert any(e.type == "Warning" and used in e.message for e in due.events), due.events
        status = due.status
        now = failed_at + timedelta(seconds=delay + 1)
        gone = [*running("qs-rdzv", "qs-worker-0")]
        recreate = step(status, gone, now, spec=spec, ensured=1)
        assert created(recreate) == ["qs-worker-1"]
        worker = recreate.actions.create[0]
        assert worker["metadata"]["annotations"]["finetune.dev/restart-attempt"] == str(attempt + 1)
        # Its torchrun may restart the workers only as often as the job has budget left.
        command = worker["spec"]["containers"][0]["command"]
        assert f"--max-restarts={3 - (attempt + 1)}" in command, command
        status = recreate.status
    # A fourth failure with 3 of 3 replacements used: Failed, every pod deleted.
    pods = [*running("qs-rdzv", "qs-worker-0"), pod("qs-worker-1", "Failed", exit_code=137)]
    out = step(status, pods, now + timedelta(hours=1), spec=spec, ensured=1)
    assert cond(out.status, COND_FAILED) == ("True", "BackoffLimitExceeded")
    assert cond(out.status, COND_SUCCEEDED) == ("False", "BackoffLimitExceeded")
    assert out.status.phase == "Failed" and out.status.completion_time is not None
    assert sorted(deleted(out)) == sorted(ALL) and created(out) == []
    assert any(e.type == "Warning" and e.reason == "BackoffLimitExceeded" for e in out.events)
    # Sticky: later passes keep it Failed and create nothing.
    later = step(out.status, [], now + timedelta(hours=2), spec=spec, ensured=1)
    assert later.status.phase == "Failed" and later.actions.empty
    assert find(later.status.conditions, COND_FAILED) == find(out.status.conditions, COND_FAILED)


def test_max_restarts_zero_fails_on_first_failure() -> None:
    spec = quickstart_raw()
    spec["faultTolerance"]["maxRestarts"] = 0
    pods = [*running("qs-rdzv", "qs-worker-0"), pod("qs-worker-1", "Failed", exit_code=1)]
    out = step(FineTuneJobStatus(), pods, T0, spec=spec)
    failed = find(out.status.conditions, COND_FAILED)
    assert out.status.phase == "Failed"
    assert failed is not None and "qs-worker-1 failed" in failed.message


def test_a_trainer_refusal_fails_the_job_at_once_without_spending_restarts() -> None:
    # The trainer refused its storage (output.uri of another job): replacing the pod would
    # refuse again, so the job fails with the trainer's message, and stays failed.
    refusal = json.dumps({"rank": 0, "error": "output.uri /out holds the export of job x/y"})
    failed = dataclasses.replace(
        pod("qs-worker-1", "Failed", exit_code=1), termination_message=refusal
    )
    pods = [*running("qs-rdzv", "qs-worker-0"), failed]
    out = step(FineTuneJobStatus(), pods, T0, ensured=1)
    assert cond(out.status, COND_FAILED) == ("True", "TrainerRefused")
    condition = find(out.status.conditions, COND_FAILED)
    assert condition is not None and "export of job x/y" in condition.message
    assert out.status.restarts == 0 and created(out) == [] and sorted(deleted(out)) == sorted(ALL)
    later = step(out.status, [], T0 + timedelta(hours=1), ensured=1)
    assert cond(later.status, COND_FAILED) == ("True", "TrainerRefused") and later.actions.empty


def test_failed_rendezvous_is_replaced_too() -> None:
    pods = [pod("qs-rdzv", "Failed", exit_code=1), *running("qs-worker-0", "qs-worker-1")]
    out = step(FineTuneJobStatus(), pods, T0 + timedelta(minutes=1), ensured=1)
    assert deleted(out) == ["qs-rdzv"] and out.status.restarts == 1


def test_terminating_pod_is_not_recreated_or_counted() -> None:
    pods = [*running("qs-rdzv", "qs-worker-0"), pod("qs-worker-1", "Failed", deleting=True)]
    out = step(FineTuneJobStatus(), pods, T0, ensured=1)
    assert out.actions.empty and out.status.restarts == 0


def test_deleted_uids_are_treated_as_terminating() -> None:
    pods = [*running("qs-rdzv", "qs-worker-0"), pod("qs-worker-1", "Failed", exit_code=1)]
    out = reconcile_job(
        JOB,
        quickstart_raw(),
        FineTuneJobStatus(restarts=1),
        pods,
        T0 + timedelta(minutes=5),
        planner=lambda _: make_plan(2),
        deleted_uids=["uid-qs-worker-1"],
        ensured_generation=1,
    )
    assert out.actions.empty and out.status.restarts == 1  # no double count


@pytest.mark.parametrize(
    ("workers", "phase", "deletes"),
    [
        (["Succeeded", "Succeeded"], "Succeeded", ["qs-rdzv"]),
        (["Succeeded", "Failed"], "Succeeded", ["qs-rdzv"]),
        (["Succeeded", "Running"], "Running", []),
    ],
    ids=["all-exit-0", "one-exit-0-other-failed", "one-still-running"],
)
def test_success(workers: list[str], phase: str, deletes: list[str]) -> None:
    pods = running("qs-rdzv")
    for i, ph in enumerate(workers):
        code = {"Succeeded": 0, "Failed": 1}.get(ph)
        pods.append(pod(f"qs-worker-{i}", ph, ready=ph == "Running", exit_code=code))
    out = step(FineTuneJobStatus(), pods, T0, ensured=1)
    assert out.status.phase == phase
    assert deleted(out) == deletes and created(out) == []
    if phase == "Succeeded":
        assert cond(out.status, COND_SUCCEEDED) == ("True", "Completed")
        assert cond(out.status, COND_FAILED) == ("False", "Completed")
        assert out.status.completion_time == iso(T0)
        later = step(out.status, [], T0 + timedelta(hours=1), ensured=1)
        assert later.status.phase == "Succeeded" and later.actions.empty


def test_suspend_and_resume() -> None:
    spec = quickstart_raw()
    s0 = step(FineTuneJobStatus(), running(*ALL), T0, spec=spec, ensured=1).status
    spec["suspend"] = True
    sus = step(s0, running(*ALL), T0 + timedelta(seconds=5), spec=spec, ensured=1)
    assert sorted(deleted(sus)) == sorted(ALL) and created(sus) == []
    assert sus.actions.ensure == ()  # ConfigMap and Services stay
    assert sus.status.phase == "Suspended"
    assert cond(sus.status, COND_SUCCEEDED) == ("Unknown", "Suspended")
    # Pods exiting non-zero on SIGTERM while suspended are not failures.
    dying = [pod("qs-worker-0", "Failed", exit_code=143)]
    quiet = step(sus.status, dying, T0 + timedelta(seconds=9), spec=spec, ensured=1)
    assert quiet.status.restarts == 0 and quiet.status.phase == "Suspended"
    spec["suspend"] = False
    resumed = step(quiet.status, [], T0 + timedelta(seconds=30), spec=spec, ensured=1)
    assert created(resumed) == list(ALL) and resumed.status.phase == "Pending"


@pytest.mark.parametrize(
    ("mutate", "planner_result", "reason", "message_part"),
    [
        (lambda s: s["training"].pop("maxSteps"), None, "InvalidSpec", "maxSteps"),
        (lambda s: s["resources"].update(minNodes=3), None, "InvalidSpec", "minNodes"),
        (lambda s: s["training"].update(bogus=1), None, "InvalidSpec", "spec.training.bogus"),
        (
            lambda s: s.update(output={"mergeLora": True}),
            None,
            "InvalidSpec",
            "output.mergeLora is true but method.type is 'full'",
        ),
        (
            lambda s: s.update(output={"uri": ""}),
            None,
            "InvalidSpec",
            "spec.output.uri: output.uri is empty",
        ),
        (
            lambda s: None,
            PlanningError("spec.model.name", "unknown model 'x'; known: llama-3.1-8b"),
            "InvalidSpec",
            "spec.model.name: unknown model",
        ),
        (lambda s: None, make_plan(2, fits=False), "PlanInfeasible", "needs 120 GiB per GPU"),
        (
            lambda s: s["training"].update(optimizer="adamw8bit"),
            None,
            "Unsupported",
            "spec.training.optimizer: adamw8bit (bitsandbytes) needs a CUDA GPU",
        ),
    ],
    ids=[
        "missing-steps",
        "min-over-max",
        "unknown-field",
        "merge-lora-of-a-full-fine-tune",
        "empty-output-uri",
        "planning-error",
        "infeasible",
        "not-implemented-by-trainer",
    ],
)
def test_refused_job_creates_nothing(
    mutate: Any, planner_result: Any, reason: str, message_part: str
) -> None:
    spec = quickstart_raw()
    mutate(spec)

    def planner(_: FineTuneJobSpec) -> Plan:
        if isinstance(planner_result, Exception):
            raise planner_result
        return planner_result or make_plan(2)

    out = reconcile_job(JOB, spec, FineTuneJobStatus(), [], T0, planner=planner)
    assert out.actions.empty
    s = out.status
    assert cond(s, COND_FAILED) == ("True", reason) and cond(s, COND_PLANNED) == ("False", reason)
    assert s.phase == "Failed"
    failed = find(s.conditions, COND_FAILED)
    assert failed is not None and message_part in failed.message
    assert any(e.type == "Warning" and e.reason == reason for e in out.events)
    # Sticky at this generation: the planner is not asked again.
    again = reconcile_job(JOB, spec, s, [], T0, planner=lambda _: pytest.fail("re-planned"))
    assert again.status == s and again.actions.empty


def test_fixed_spec_runs_after_refusal() -> None:
    bad = reconcile_job(
        JOB,
        quickstart_raw(),
        FineTuneJobStatus(),
        [],
        T0,
        planner=lambda _: make_plan(2, fits=False),
    )
    fixed = JobRef(JOB.name, JOB.namespace, JOB.uid, generation=2)
    out = step(bad.status, [], T0 + timedelta(minutes=1), job=fixed)
    assert out.status.phase == "Pending" and created(out) == list(ALL)
    assert cond(out.status, COND_FAILED) == ("False", "Pending")
    assert out.status.completion_time is None


def test_too_long_name_is_refused() -> None:
    job = JobRef("x" * 60, "ns", UID, 1)
    out = step(FineTuneJobStatus(), [], T0, job=job)
    assert out.actions.empty and cond(out.status, COND_FAILED) == ("True", "InvalidSpec")


@pytest.mark.parametrize("name", ["my.job", "1job"])
def test_name_no_service_can_take_is_refused(name: str) -> None:
    # The API server stores such a job; its Services (`<name>`, `<name>-rdzv`) it would refuse.
    out = step(FineTuneJobStatus(), [], T0, job=JobRef(name, "ns", UID, 1))
    assert out.actions.empty and cond(out.status, COND_FAILED) == ("True", "InvalidSpec")
    assert "DNS-1035" in str(find(out.status.conditions, COND_FAILED).message)


def test_replacement_keeps_off_excluded_nodes() -> None:
    status = FineTuneJobStatus(excluded_nodes=["slow-node"])
    out = step(status, running("qs-rdzv", "qs-worker-0"), T0, ensured=1)
    assert created(out) == ["qs-worker-1"]
    affinity = out.actions.create[0]["spec"]["affinity"]
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["slow-node"]


def test_plan_is_reused_within_a_generation() -> None:
    s0 = step(FineTuneJobStatus(), [], T0).status
    out = reconcile_job(JOB, quickstart_raw(), s0, [], T0, planner=lambda _: pytest.fail("again"))
    assert out.status.plan == s0.plan
