"""Least privilege (issue 11.7): the job policy, no API token in pods, a NetworkPolicy per job."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import kubernetes_validate
import pytest

from finetune_operator.api.constants import COND_FAILED, DEFAULT_TRAINER_IMAGE, LABEL_JOB
from finetune_operator.api.policy import JobPolicy, policy_refusals, with_policy_defaults
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import JobRef, reconcile_job
from finetune_operator.reconcile.conditions import find
from finetune_operator.resources import (
    Owner,
    build_network_policy,
    build_rendezvous_pod,
    build_shared_objects,
    build_worker_pod,
)
from finetune_operator.settings import parse_operator_args
from tests.operator.factories import make_plan, quickstart_raw

CHART_POLICY = JobPolicy(
    trainer_image="registry.example/trainer:1.0",
    allowed_images=("registry.example/trainer:*",),
    trainer_service_account="finetune-trainer",
    allowed_service_accounts=(),
)


def _spec(**resources: Any) -> FineTuneJobSpec:
    raw = quickstart_raw()
    raw["resources"].update(resources)
    return FineTuneJobSpec.model_validate(raw)


@pytest.mark.parametrize(
    ("image", "account", "refused"),
    [
        (None, None, []),
        ("registry.example/trainer:1.0", None, []),
        ("registry.example/trainer:1.1-rc", "finetune-trainer", []),
        ("evil.example/miner:latest", None, ["spec.image"]),
        (None, "cluster-admin-sa", ["spec.resources.serviceAccountName"]),
        ("registry.example/other:1", "default", ["spec.image", "spec.resources.serviceAccountName"]),
    ],
    ids=["defaults", "trainer-image", "allowed-glob", "image", "service-account", "both"],
)  # fmt: skip
def test_policy_refuses_images_and_accounts_naming_the_field(
    image: str | None, account: str | None, refused: list[str]
) -> None:
    spec = _spec(serviceAccountName=account).model_copy(update={"image": image})
    refusals = policy_refusals(spec, CHART_POLICY)
    assert [r.split(" ", 1)[0] for r in refusals] == refused


def test_defaults_fill_the_trainer_image_and_account_and_the_library_default_allows_all() -> None:
    spec = with_policy_defaults(_spec(), CHART_POLICY)
    assert spec.image == "registry.example/trainer:1.0"
    assert spec.resources.service_account_name == "finetune-trainer"
    anything = _spec(serviceAccountName="x").model_copy(update={"image": "y"})
    assert policy_refusals(anything, JobPolicy()) == []
    assert with_policy_defaults(_spec(), JobPolicy()).image == DEFAULT_TRAINER_IMAGE


def test_the_cli_policy_allows_only_the_trainer_image_and_account_by_default() -> None:
    policy = parse_operator_args(["--trainer-service-account", "trainer"]).policy
    assert policy.allowed_images == () and policy.allowed_service_accounts == ()
    assert not policy.network_policy
    spec = _spec(serviceAccountName="default").model_copy(update={"image": "other:1"})
    assert len(policy_refusals(spec, policy)) == 2
    assert policy_refusals(_spec(serviceAccountName="trainer"), policy) == []


def test_a_job_outside_the_policy_fails_with_not_allowed_and_creates_nothing() -> None:
    raw = quickstart_raw()
    raw["image"] = "evil.example/miner:latest"
    job = JobRef(name="qs", namespace="ml", uid="uid-1", generation=1)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    out = reconcile_job(
        job, raw, FineTuneJobStatus(), [], now, planner=lambda _: make_plan(2), policy=CHART_POLICY
    )
    failed = find(out.status.conditions, COND_FAILED)
    assert failed is not None and (failed.status, failed.reason) == ("True", "NotAllowed")
    assert "spec.image 'evil.example/miner:latest'" in failed.message
    assert out.actions.create == () and out.actions.ensure == ()


def test_pods_get_the_policy_defaults_and_no_api_token() -> None:
    job = JobRef(name="qs", namespace="ml", uid="uid-1", generation=1)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    out = reconcile_job(
        job, quickstart_raw(), FineTuneJobStatus(), [], now, planner=lambda _: make_plan(2),
        policy=CHART_POLICY,
    )  # fmt: skip
    pods = [o for o in out.actions.create if o["kind"] == "Pod"]
    assert len(pods) == 3
    for pod in pods:
        assert pod["spec"]["automountServiceAccountToken"] is False
        assert pod["spec"]["serviceAccountName"] == "finetune-trainer"
        assert pod["spec"]["containers"][0]["image"] == "registry.example/trainer:1.0"


def test_a_job_may_ask_for_its_token() -> None:
    owner = Owner(name="qs", namespace="ml", uid="uid-1")
    spec = _spec(automountServiceAccountToken=True)
    assert build_worker_pod(owner, spec, make_plan(2), 0)["spec"]["automountServiceAccountToken"]
    assert build_rendezvous_pod(owner, spec)["spec"]["automountServiceAccountToken"]


@pytest.mark.parametrize("version", ["1.28", "1.32", "1.35"])
def test_network_policy_admits_only_the_job_and_the_scrapers(version: str) -> None:
    owner = Owner(name="qs", namespace="ml", uid="uid-1")
    policy = build_network_policy(owner, 2, ["ops", "monitoring"])
    kubernetes_validate.validate(policy, version, strict=True)
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {LABEL_JOB: "qs"}}
    assert spec["policyTypes"] == ["Ingress"]
    own, scrapers = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {LABEL_JOB: "qs"}}}]}
    assert [p["port"] for p in scrapers["ports"]] == [9400, 9401]
    selector = scrapers["from"][0]["namespaceSelector"]["matchExpressions"][0]
    assert selector["values"] == ["monitoring", "ops"]


def test_network_policy_is_a_shared_object_only_when_the_policy_asks() -> None:
    owner = Owner(name="qs", namespace="ml", uid="uid-1")
    spec, plan = _spec(), make_plan(2)
    assert "NetworkPolicy" not in [o["kind"] for o in build_shared_objects(owner, spec, plan)]
    with_np = build_shared_objects(owner, spec, plan, network_policy=("ops",))
    assert [o["kind"] for o in with_np][-1] == "NetworkPolicy"
    job = JobRef(name="qs", namespace="ml", uid="uid-1", generation=1)
    policy = JobPolicy(
        network_policy=True, operator_namespace="ops", monitoring_namespaces=("mon",)
    )
    out = reconcile_job(
        job, quickstart_raw(), FineTuneJobStatus(), [], datetime(2026, 1, 1, tzinfo=UTC),
        planner=lambda _: plan, policy=policy,
    )  # fmt: skip
    kinds = [o["kind"] for o in out.actions.ensure]
    assert "NetworkPolicy" in kinds


def test_cluster_api_creates_and_updates_the_network_policy(tmp_path: Any) -> None:
    import asyncio

    from finetune_local.cluster import LocalCluster
    from finetune_operator.reconcile.apply import ClusterApi, load_api_client

    owner = Owner(name="qs", namespace="default", uid="uid-1")
    with LocalCluster(tmp_path, kubelet=False) as cluster:
        api = ClusterApi(load_api_client(str(cluster.kubeconfig_path)))
        first = build_network_policy(owner, 1, ["ops"])
        second = build_network_policy(owner, 2, ["ops", "monitoring"])
        assert asyncio.run(api.ensure(first)) is True
        assert asyncio.run(api.ensure(second)) is False  # updated in place
        stored = api.networking.read_namespaced_network_policy("qs-network", "default")
        assert [p.port for p in stored.spec.ingress[1].ports] == [9400, 9401]
