"""The operator's read of a terminating pod's Node (ClusterApi.read_node), against the local API
server over HTTP: a Node seen as the decision needs it, a deleted one as absent, and one the
operator may not read (RBAC) as a reason to report, never an exception."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from finetune_local.cluster import LocalCluster
from finetune_operator.reconcile.apply import ClusterApi
from finetune_operator.reconcile.nodeloss import NodeView
from tests.operator.test_reconcile import T0, iso

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterApi]:
    with LocalCluster(tmp_path_factory.mktemp("api"), crds_dir=None, kubelet=False) as local:
        yield ClusterApi(config.new_client_from_config(config_file=str(local.kubeconfig_path)))


def test_read_node_sees_ready_absent_and_forbidden(api: ClusterApi, monkeypatch: Any) -> None:
    api.core.create_node({"metadata": {"name": "gone-dark"}})
    ready = {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
             "lastTransitionTime": iso(T0)}  # fmt: skip
    api.core.patch_node_status("gone-dark", {"status": {"conditions": [ready]}})
    assert asyncio.run(api.read_node("gone-dark")) == (
        NodeView("gone-dark", True, "Unknown", T0, "NodeStatusUnknown"),
        "",
    )
    assert asyncio.run(api.read_node("never-was")) == (NodeView("never-was", exists=False), "")

    def forbidden(*_: Any, **__: Any) -> client.V1Node:
        raise ApiException(status=403, reason="Forbidden")

    monkeypatch.setattr(api.core, "read_node", forbidden)
    view, why = asyncio.run(api.read_node("gone-dark"))
    assert view is None
    assert "HTTP 403 Forbidden" in why and "get on nodes" in why and "ClusterRole" in why
