"""The chart's Kueue value: RBAC on exactly what the operator calls on Kueue's objects
(reconcile/apply.py: Workloads created, read, patched and deleted (one written for an
earlier spec of its job), their status patched; listed and watched by the operator's Workload
event handler (handlers/workloads.py); the
ResourceFlavors an admission names and the priority class a Workload is created with, read), absent by default, in the ClusterRole or in each
watched namespace's Role, and every rendered object valid."""

from __future__ import annotations

from typing import Any

import kubernetes_validate

from tests.chart.conftest import Render, only
from tests.chart.test_chart import _grants

WORKLOADS = ("kueue.x-k8s.io", "workloads")
STATUS = ("kueue.x-k8s.io", "workloads/status")
FLAVORS = ("kueue.x-k8s.io", "resourceflavors")
WPC = ("kueue.x-k8s.io", "workloadpriorityclasses")
PRIORITY = ("scheduling.k8s.io", "priorityclasses")


def _kueue_grants(docs: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    return {k: v for k, v in _grants(docs).items() if k[0] == "kueue.x-k8s.io" or k == PRIORITY}


def test_absent_by_default(render: Render) -> None:
    assert _kueue_grants(render()) == {}


def test_cluster_wide_grants_workloads_and_flavors(render: Render) -> None:
    docs = render("kueue.enabled=true")
    grants = _kueue_grants([only(docs, "ClusterRole")])
    assert grants == {
        WORKLOADS: {"create", "get", "list", "watch", "patch", "delete"},
        STATUS: {"patch"},
        FLAVORS: {"get"},
        WPC: {"get"},
        PRIORITY: {"get"},
    }
    for doc in docs:
        if doc["kind"] in ("ClusterRole", "Role"):
            kubernetes_validate.validate(doc, "1.32", strict=True)


def test_namespaced_mode_grants_workloads_per_namespace_and_flavors_cluster_wide(
    render: Render,
) -> None:
    docs = render(
        "kueue.enabled=true", "operator.clusterWide=false", "operator.watchNamespaces={ml,research}"
    )
    # Flavors and priority classes are cluster-scoped: a Role cannot grant them.
    assert _kueue_grants([only(docs, "ClusterRole")]) == {
        FLAVORS: {"get"},
        WPC: {"get"},
        PRIORITY: {"get"},
    }
    roles = [d for d in docs if d["kind"] == "Role"]
    assert len(roles) == 2
    for role in roles:
        assert _kueue_grants([role]) == {
            WORKLOADS: {"create", "get", "list", "watch", "patch", "delete"},
            STATUS: {"patch"},
        }
