"""The apply layer with gang scheduling, against the local API server over HTTP: the PodGroup
before the pods, and no worker pod (but a clear reason) where the PodGroup CRD is missing;
its status read back as the gang scheduler wrote it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from kubernetes import client, config

from finetune_local.cluster import LocalCluster
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.reconcile.actions import Actions, ObjectRef
from finetune_operator.reconcile.apply import ClusterApi
from finetune_operator.reconcile.gang import GangVerdict, read_gang
from finetune_operator.resources import (
    Owner,
    build_job_pod_group,
    build_rendezvous_pod,
    build_worker_pod,
)
from tests.operator.factories import UID, make_plan, quickstart_raw

OWNER = Owner(name="gang", namespace="default", uid=UID)
pytestmark = pytest.mark.slow


@pytest.fixture(
    scope="module", params=[(), ("coscheduling", "volcano")], ids=["not-installed", "installed"]
)
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


def test_pod_group_status_read_as_the_scheduler_wrote_it(server: LocalCluster) -> None:
    """The local cluster places gangs but writes no PodGroup status: the test writes it, as
    Volcano's scheduler does, through the status subresource."""
    api_client = config.new_client_from_config(config_file=str(server.kubeconfig_path))
    cluster = ClusterApi(api_client)
    installed = bool(server.api.registry.get("scheduling.volcano.sh", "v1beta1", "podgroups"))
    volcano = "scheduling.volcano.sh/v1beta1"
    absent, why = asyncio.run(cluster.read_pod_group("default", volcano, "vc"))
    if not installed:
        assert absent is None
        assert "HTTP 404" in why and "podgroups.scheduling.volcano.sh" in why
        assert read_gang(absent, "vc", why).verdict is GangVerdict.UNKNOWN
        return
    assert (absent, why) == (None, "")  # not created yet: no error
    raw = quickstart_raw()
    raw["resources"]["gangScheduling"] = {"scheduler": "volcano"}
    owner = Owner(name="vc", namespace="default", uid=UID)
    body = build_job_pod_group(owner, FineTuneJobSpec.model_validate(raw), make_plan(2))
    assert body is not None
    asyncio.run(cluster.ensure_custom(body, "podgroups"))
    status = {"phase": "Inqueue", "conditions": [{
        "type": "Unschedulable", "status": "True", "reason": "NotEnoughResources",
        "message": "1/1 tasks in gang unschedulable: pod group is not ready, 1 Pending, 1 minAvailable",
        "lastTransitionTime": "2026-01-01T12:00:00Z", "transitionID": "t1"}]}  # fmt: skip
    client.CustomObjectsApi(api_client).patch_namespaced_custom_object_status(
        "scheduling.volcano.sh", "v1beta1", "default", "podgroups", "vc", {"status": status}
    )
    found, why = asyncio.run(cluster.read_pod_group("default", volcano, "vc"))
    assert why == "" and found is not None
    reading = read_gang(found, "vc")
    assert (reading.verdict, reading.min_member, reading.reason) == (
        GangVerdict.WAITING, 1, "NotEnoughResources"
    )  # fmt: skip
    assert reading.describe().startswith("waiting for gang: 0/1 pods placed (PodGroup vc Inqueue)")
    # Re-applying the group (a new generation) leaves the scheduler's status alone.
    asyncio.run(cluster.ensure_custom(body, "podgroups"))
    again, _ = asyncio.run(cluster.read_pod_group("default", volcano, "vc"))
    assert again is not None and read_gang(again, "vc") == reading
