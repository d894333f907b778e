"""The chart's least privilege (issue 11.7) and the Kubernetes versions it claims.

- the chart renders and every object validates on every minor version from its kubeVersion
  floor to the newest kubernetes-validate knows, and the floor is what the CRD really needs;
- the trainer ServiceAccount is bound to nothing and mounts no token;
- the job policy and the NetworkPolicy switch reach the operator as flags the real CLI parses.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from finetune_operator.settings import parse_operator_args
from tests.chart.conftest import ALL_OPTIONAL, CHART, Render, only, template
from tests.chart.test_chart import _grants, check_objects

FLOOR = (1, 28)  # CEL rules with fieldPath/reason: see test_the_floor_is_what_the_crd_needs


def _claimed_minors() -> list[str]:
    newest = int(latest_version().split(".")[1])
    return [f"1.{minor}" for minor in range(FLOOR[1], newest + 1)]


def test_chart_claims_the_floor() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={FLOOR[0]}.{FLOOR[1]}.0-0"


def test_the_floor_is_what_the_crd_needs() -> None:
    crd = yaml.safe_load((CHART / "crds" / "finetunejobs.finetune.dev.yaml").read_text())
    text = yaml.safe_dump(crd)
    assert "fieldPath:" in text and "reason:" in text  # the features that need 1.28
    kubernetes_validate.validate(crd, "1.28", strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(crd, "1.27", strict=True)


def test_helm_refuses_a_cluster_below_the_floor(helm: Path) -> None:
    proc = template(helm, extra=["--kube-version", "1.27.9"])
    assert proc.returncode != 0 and "kubeVersion" in proc.stderr


@pytest.mark.parametrize("version", _claimed_minors())
def test_renders_and_validates_on_every_claimed_version(helm: Path, version: str) -> None:
    sets = (*ALL_OPTIONAL, "operator.clusterWide=false", "operator.watchNamespaces={ml,research}")
    proc = template(helm, sets, extra=["--include-crds", "--kube-version", f"{version}.0"])
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    check_objects(docs, version)


def _trainer_accounts(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"].endswith("-trainer")]  # fmt: skip


def test_trainer_service_account_has_no_token_and_no_rbac(render: Render) -> None:
    docs = render()
    (account,) = _trainer_accounts(docs)
    assert account["automountServiceAccountToken"] is False
    assert account["metadata"]["namespace"] == "ops"
    for binding in (d for d in docs if d["kind"] in {"RoleBinding", "ClusterRoleBinding"}):
        assert all(s["name"] != account["metadata"]["name"] for s in binding["subjects"])
    namespaced = render("operator.clusterWide=false", "operator.watchNamespaces={ml,research}")
    assert sorted(a["metadata"]["namespace"] for a in _trainer_accounts(namespaced)) == ["ml", "research"]  # fmt: skip
    listed = render("trainer.serviceAccount.namespaces={a,b,c}")
    assert sorted(a["metadata"]["namespace"] for a in _trainer_accounts(listed)) == ["a", "b", "c"]
    assert _trainer_accounts(render("trainer.serviceAccount.create=false")) == []


def _operator_args(docs: list[dict[str, Any]]) -> list[str]:
    args: list[str] = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def test_policy_values_reach_the_operator_as_the_policy_they_describe(render: Render) -> None:
    docs = render(
        "trainer.image.repository=registry.example/trainer",
        "trainer.image.digest=sha256:" + "b" * 64,
        "policy.allowedImages={registry.example/trainer:*}",
        "policy.allowedServiceAccounts={s3-reader}",
        "networkPolicy.monitoringNamespaces={monitoring}",
    )
    policy = parse_operator_args(_operator_args(docs)).policy
    assert policy.trainer_image == "registry.example/trainer@sha256:" + "b" * 64
    assert policy.allowed_images == ("registry.example/trainer:*",)
    assert policy.trainer_service_account == "rel-finetune-operator-trainer"
    assert policy.allowed_service_accounts == ("s3-reader",)
    assert policy.network_policy and policy.monitoring_namespaces == ("monitoring",)
    defaults = parse_operator_args(_operator_args(render())).policy
    assert defaults.allowed_images == () and defaults.allowed_service_accounts == ()


def test_network_policy_rbac_only_when_enabled(render: Render) -> None:
    grants = _grants(render())
    assert grants[("networking.k8s.io", "networkpolicies")] == {
        "create", "delete", "get", "list", "watch", "patch"
    }  # fmt: skip
    off = render("networkPolicy.enabled=false")
    assert ("networking.k8s.io", "networkpolicies") not in _grants(off)
    assert not any(re.match("--network-policy|--monitoring-namespace", a) for a in _operator_args(off))  # fmt: skip
    namespaced = render("operator.clusterWide=false", "operator.watchNamespaces={ml}")
    assert ("networking.k8s.io", "networkpolicies") in _grants([only(namespaced, "Role")])
