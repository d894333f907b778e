"""Gang scheduling: the PodGroup and its members (pure builders), the API's checks, the
operator's default from its flags, and when a reconcile pass ensures or removes the group."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import kubernetes_validate
import pytest
from pydantic import ValidationError

from finetune_local.podgroups import GANG_SCHEDULERS
from finetune_operator.api.constants import LABEL_JOB, LABEL_ROLE, LABEL_WORKER_INDEX
from finetune_operator.api.policy import with_policy_defaults
from finetune_operator.api.schema_validation import CustomResourceSchema
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import observe_pod
from finetune_operator.reconcile.actions import ObjectRef
from finetune_operator.resources import (
    Owner,
    build_job_pod_group,
    build_rendezvous_pod,
    build_worker_pod,
    desired_objects,
)
from finetune_operator.resources.podgroup import GANG_APIS, scale_quantity
from finetune_operator.settings import parse_operator_args
from tests.operator.factories import EIGHT_GPU_SPEC, make_plan, quickstart_raw
from tests.operator.test_reconcile import ALL, T0, created, running, step


def _spec(gang: dict[str, Any] | None, base: dict[str, Any] | None = None) -> FineTuneJobSpec:
    raw = copy.deepcopy(base or EIGHT_GPU_SPEC)
    if gang is not None:
        raw["resources"]["gangScheduling"] = gang
    return FineTuneJobSpec.model_validate(raw)


def _crd_schema(scheduler: str) -> CustomResourceSchema:
    crd = GANG_SCHEDULERS[scheduler].crd()
    return CustomResourceSchema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize(
    ("gang", "min_member", "extra"),
    [
        (
            {"scheduler": "coscheduling", "scheduleTimeoutSeconds": 120},
            1,
            {"scheduleTimeoutSeconds": 120},
        ),
        (
            {"scheduler": "volcano", "queue": "research"},
            1,
            {"queue": "research", "priorityClassName": "training"},
        ),
    ],
    ids=["coscheduling", "volcano"],
)
def test_pod_group_min_member_is_the_elastic_minimum(
    owner: Owner, gang: dict[str, Any], min_member: int, extra: dict[str, Any]
) -> None:
    spec = _spec(gang)  # minNodes 1, maxNodes 2, 8 GPUs, cpu 32, memory 512Gi per pod
    group = build_job_pod_group(owner, spec, make_plan(2, 8))
    assert group is not None
    api = GANG_APIS[gang["scheduler"]]
    assert group["apiVersion"] == api.api_version and group["kind"] == "PodGroup"
    assert group["metadata"]["name"] == owner.name
    assert group["metadata"]["ownerReferences"][0]["uid"] == owner.uid
    assert group["spec"] == {
        "minMember": min_member,
        # The data cache's disk (dataset.cacheSizeLimit) is requested too: a node without it
        # cannot take a member.
        "minResources": {
            "cpu": "32",
            "ephemeral-storage": "32Gi",
            "memory": "512Gi",
            "nvidia.com/gpu": "8",
        },
        **extra,
    }
    # As the scheduler's CRD declares it: nothing pruned, nothing refused.
    schema = _crd_schema(gang["scheduler"])
    assert schema.unknown_fields(group) == []
    assert schema.validate(schema.normalise(group)) == []


def test_min_resources_scale_with_min_nodes(owner: Owner) -> None:
    raw = copy.deepcopy(EIGHT_GPU_SPEC)
    raw["resources"].update(minNodes=3, maxNodes=4, cpu="1500m")
    raw["resources"]["gangScheduling"] = {"scheduler": "coscheduling"}
    group = build_job_pod_group(owner, FineTuneJobSpec.model_validate(raw), make_plan(4, 8))
    assert group is not None
    assert group["spec"]["minMember"] == 3
    assert group["spec"]["minResources"] == {
        "cpu": "4500m",
        "ephemeral-storage": "96Gi",
        "memory": "1536Gi",
        "nvidia.com/gpu": "24",
    }


@pytest.mark.parametrize(
    ("value", "times", "expected"),
    [
        ("8", 2, "16"),
        ("500m", 3, "1500m"),
        ("64Gi", 2, "128Gi"),
        ("0.5", 4, "2"),
        ("1.5G", 3, "4.5G"),
        ("1e3", 2, "2000"),
        ("2E", 2, "4E"),
    ],
)
def test_scale_quantity(value: str, times: int, expected: str) -> None:
    assert scale_quantity(value, times) == expected


def test_scale_quantity_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="lots"):
        scale_quantity("lots", 2)


def test_an_unreadable_request_is_left_out_of_min_resources(owner: Owner) -> None:
    raw = copy.deepcopy(EIGHT_GPU_SPEC)
    raw["resources"].update(cpu="eight", gangScheduling={"scheduler": "volcano"})
    group = build_job_pod_group(owner, FineTuneJobSpec.model_validate(raw), make_plan(2, 8))
    assert group is not None and "cpu" not in group["spec"]["minResources"]


@pytest.mark.parametrize("scheduler", ["coscheduling", "volcano"])
def test_worker_pods_join_the_group_and_the_rendezvous_pod_does_not(
    owner: Owner, scheduler: str
) -> None:
    spec = _spec({"scheduler": scheduler})
    plan = make_plan(2, 8)
    local = GANG_SCHEDULERS[scheduler]  # the local cluster's independent reading of the scheduler
    for index in range(2):
        pod = build_worker_pod(owner, spec, plan, index)
        kubernetes_validate.validate(pod, "1.32", strict=True)
        assert pod["spec"]["schedulerName"] == local.name
        assert local.group_of(pod) == owner.name
        assert pod["metadata"]["labels"][LABEL_ROLE] == "worker"  # own labels kept
    rendezvous = build_rendezvous_pod(owner, spec)
    assert "schedulerName" not in rendezvous["spec"] and local.group_of(rendezvous) is None


def test_scheduler_name_override(owner: Owner) -> None:
    spec = _spec({"scheduler": "coscheduling", "schedulerName": "default-scheduler"})
    assert (
        build_worker_pod(owner, spec, make_plan(2, 8), 0)["spec"]["schedulerName"]
        == "default-scheduler"
    )


@pytest.mark.parametrize("gang", [None, {"scheduler": "none"}], ids=["unset", "none"])
def test_off_changes_nothing(owner: Owner, gang: dict[str, Any] | None) -> None:
    spec = _spec(gang)
    plan = make_plan(2, 8)
    assert build_job_pod_group(owner, spec, plan) is None
    assert [o["kind"] for o in desired_objects(owner, spec, plan)].count("PodGroup") == 0
    pod = build_worker_pod(owner, spec, plan, 0)
    assert pod == build_worker_pod(owner, _spec(None), plan, 0)
    assert "schedulerName" not in pod["spec"]


@pytest.mark.parametrize(
    ("gang", "field"),
    [
        ({"scheduler": "volcano", "scheduleTimeoutSeconds": 60}, "scheduleTimeoutSeconds"),
        ({"scheduler": "coscheduling", "queue": "q"}, "gangScheduling.queue"),
        ({"scheduler": "none", "schedulerName": "x"}, "gangScheduling.schedulerName"),
        ({"scheduler": "kueue"}, "scheduler"),
        ({"scheduler": "coscheduling", "scheduleTimeoutSeconds": 0}, "scheduleTimeoutSeconds"),
        ({}, "scheduler"),
    ],
    ids=[
        "timeout-volcano",
        "queue-coscheduling",
        "name-none",
        "unknown",
        "zero-timeout",
        "missing",
    ],
)
def test_invalid_gang_scheduling_names_the_field(gang: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError, match=field.split(".")[-1]):
        _spec(gang)


def test_operator_default_from_flags() -> None:
    settings = parse_operator_args(["--gang-scheduler=volcano", "--gang-scheduler-name=vc"], env={})
    policy = settings.policy
    assert (policy.gang_scheduler, policy.gang_scheduler_name) == ("volcano", "vc")
    unset = with_policy_defaults(_spec(None), policy).resources.gang_scheduling
    assert unset is not None and (unset.scheduler, unset.scheduler_name) == ("volcano", "vc")
    # A job's own choice wins; the default scheduler name applies to the default scheduler only.
    opted_out = with_policy_defaults(_spec({"scheduler": "none"}), policy).resources.gang_scheduling
    assert opted_out is not None and not opted_out.enabled
    other = with_policy_defaults(
        _spec({"scheduler": "coscheduling"}), policy
    ).resources.gang_scheduling
    assert other is not None and other.scheduler_name is None
    assert parse_operator_args([], env={}).policy.gang_scheduler is None  # off by default


# ---------------------------------------------------------------- reconcile


def _gang_raw() -> dict[str, Any]:
    raw = quickstart_raw()
    raw["resources"]["gangScheduling"] = {"scheduler": "coscheduling"}
    return raw


def test_pod_group_is_ensured_with_the_pods_and_not_on_a_quiet_pass() -> None:
    first = step(FineTuneJobStatus(), [], T0, spec=_gang_raw())
    group = first.actions.pod_group
    assert group is not None and group["spec"]["minMember"] == 1  # the quickstart's minNodes
    assert created(first) == list(ALL)
    quiet = step(
        first.status, running(*ALL), T0 + timedelta(seconds=2), spec=_gang_raw(), ensured=1
    )
    assert quiet.actions.pod_group is None and quiet.actions.empty
    # A worker to replace: the group is ensured again before it (it may have been deleted).
    lost = step(quiet.status, running("qs-rdzv", "qs-worker-0"), T0 + timedelta(seconds=4),
                spec=_gang_raw(), ensured=1)  # fmt: skip
    assert created(lost) == ["qs-worker-1"] and lost.actions.pod_group is not None


def test_suspended_job_gives_its_pod_group_back_and_a_resumed_one_gets_it_again() -> None:
    first = step(FineTuneJobStatus(), [], T0, spec=_gang_raw())
    live = running(*ALL)
    suspended = _gang_raw() | {"suspend": True}
    out = step(first.status, live, T0 + timedelta(seconds=2), spec=suspended, ensured=1)
    ref = ObjectRef("scheduling.x-k8s.io/v1alpha1", "PodGroup", "podgroups", "qs")
    assert out.actions.remove == (ref,)
    # Once the pods are gone nothing more is deleted on every pass.
    gone = step(out.status, [], T0 + timedelta(seconds=4), spec=suspended, ensured=1)
    assert gone.actions.remove == () and gone.actions.empty
    resumed = step(gone.status, [], T0 + timedelta(seconds=6), spec=_gang_raw(), ensured=1)
    assert resumed.actions.pod_group is not None and "qs-worker-0" in created(resumed)


def test_without_gang_scheduling_no_pod_group_action() -> None:
    out = step(FineTuneJobStatus(), [], T0)
    assert out.actions.pod_group is None and out.actions.remove == ()


def test_an_unschedulable_worker_says_why_in_the_job_status() -> None:
    message = (
        "0/5 nodes are available: 5 Too many pods. The pod group needs 2 pods at once and 1 fit"
    )
    waiting = observe_pod({
        "metadata": {"name": "qs-worker-0", "uid": "u0",
                     "labels": {LABEL_JOB: "qs", LABEL_ROLE: "worker", LABEL_WORKER_INDEX: "0"}},
        "spec": {},
        "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]},
    })  # fmt: skip
    assert waiting.blocked == f"Unschedulable: {message}"
    out = step(FineTuneJobStatus(), [*running("qs-rdzv"), waiting], T0, spec=_gang_raw())
    succeeded = next(c for c in out.status.conditions if c.type == "Succeeded")
    assert (
        succeeded.reason == "Pending"
        and f"pod qs-worker-0 cannot start: Unschedulable: {message}" in succeeded.message
    )
