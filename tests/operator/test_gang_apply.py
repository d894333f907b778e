"""The apply layer with gang scheduling, against the local API server over HTTP: the PodGroup
before the pods, and no worker pod (but a clear reason) where the PodGroup CRD is missing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from kubernetes import client, config

from finetune_local.cluster import LocalCluster
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.reconcile.actions import Actions, ObjectRef
from finetune_operator.reconcile.apply import ClusterApi
from finetune_operator.resources import (
    Owner,
    build_job_pod_group,
    build_rendezvous_pod,
    build_worker_pod,
)
from tests.operator.factories import UID, make_plan, quickstart_raw

OWNER = Owner(name="gang", namespace="default", uid=UID)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[(), ("coscheduling",)], ids=["not-installed", "installed"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("api"), crds_dir=None, kubelet=False,
                      gang_schedulers=request.param) as local:  # fmt: skip
        yield local


def _actions() -> Actions:
    raw = quickstart_raw()
    raw["resources"]["gangScheduling"] = {"scheduler": "coscheduling"}
    spec, plan = FineTuneJobSpec.model_validate(raw), make_plan(2)
    pods = (
        build_rendezvous_pod(OWNER, spec),
        *(build_worker_pod(OWNER, spec, plan, i) for i in range(2)),
    )
    return Actions(create=pods, pod_group=build_job_pod_group(OWNER, spec, plan))


def test_worker_pods_only_with_their_pod_group(server: LocalCluster) -> None:
    api_client = config.new_client_from_config(config_file=str(server.kubeconfig_path))
    cluster = ClusterApi(api_client)
    installed = bool(server.api.registry.get("scheduling.x-k8s.io", "v1alpha1", "podgroups"))
    result = asyncio.run(cluster.apply("default", _actions()))
    pods = {
        p.metadata.name for p in client.CoreV1Api(api_client).list_namespaced_pod("default").items
    }
    if installed:
        assert result.errors == []
        assert pods == {"gang-rdzv", "gang-worker-0", "gang-worker-1"}
        group = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
            "scheduling.x-k8s.io", "v1alpha1", "default", "podgroups", "gang"
        )
        assert group["spec"]["minMember"] == 1
        assert group["metadata"]["ownerReferences"][0]["name"] == "gang"
        # Applying again (a re-form) updates it in place; a finished job deletes it.
        again = asyncio.run(cluster.apply("default", _actions()))
        assert again.errors == []
        ref = ObjectRef("scheduling.x-k8s.io/v1alpha1", "PodGroup", "podgroups", "gang")
        assert asyncio.run(cluster.remove("default", ref)) is True
        assert asyncio.run(cluster.remove("default", ref)) is False  # already gone: fine
    else:
        # The store may start; no worker holds a node outside its group.
        assert pods == {"gang-rdzv"}
        (error,) = result.errors
        assert "podgroups.scheduling.x-k8s.io" in error and "HTTP 404" in error
        assert "spec.resources.gangScheduling" in error
