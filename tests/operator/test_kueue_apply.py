"""The apply layer with Kueue, against the local API server over HTTP: the Workload created
(then only its `active` patched, or its podSets when stale), read back with the flavors its admission names, its status
patched as Kueue's job controllers do; and where Kueue is not installed, a clear reason."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import kopf
import pytest
from kubernetes import config

from finetune_local.cluster import LocalCluster
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.reconcile.actions import Actions
from finetune_operator.reconcile.admission import flavors_assigned, read_queue_state
from finetune_operator.reconcile.apply import ClusterApi
from finetune_operator.reconcile.workload_patches import finish_patch
from finetune_operator.resources import Owner
from finetune_operator.resources.workload import build_workload
from tests.operator.factories import UID, make_plan, quickstart_raw

OWNER = Owner(name="queued", namespace="default", uid=UID)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[False, True], ids=["not-installed", "installed"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    with LocalCluster(
        tmp_path_factory.mktemp("api"), crds_dir=None, kubelet=False, kueue=request.param
    ) as local:
        yield local


def _workload(suspend: bool = False) -> dict[str, Any]:
    spec = FineTuneJobSpec.model_validate(quickstart_raw() | {"suspend": suspend})
    return build_workload(OWNER, spec, make_plan(2), "q")


def test_workload_written_read_and_finished(server: LocalCluster) -> None:
    cluster = ClusterApi(config.new_client_from_config(config_file=str(server.kubeconfig_path)))
    installed = bool(server.api.registry.get("kueue.x-k8s.io", "v1beta2", "workloads"))
    result = asyncio.run(cluster.apply("default", Actions(workload=_workload())))
    if not installed:
        (error,) = result.errors
        assert "workloads.kueue.x-k8s.io/v1beta2" in error and "HTTP 404" in error
        assert "install Kueue" in error and "kueue.x-k8s.io/queue-name" in error
        # Not served: unreadable, with why (not "absent": that would stop running workers).
        found, why = asyncio.run(cluster.read_workload("default", "queued"))
        assert found is None and "install Kueue" in why
        # A job whose label was removed once Kueue is gone: no Workload can exist, so it
        # runs without Kueue (not held as an unknown admission for good).
        from finetune_operator.handlers.workloads import queue_state
        from finetune_operator.reconcile import JobRef

        job = JobRef(name="queued", namespace="default", uid=UID, generation=1)
        body = kopf.Body({"metadata": {"name": "queued"}, "status": {"workload": "queued"}})
        assert asyncio.run(queue_state(cluster, job, body)) is None
        return
    assert result.errors == []
    assert asyncio.run(cluster.read_workload("default", "never-written")) == (
        None,
        "",
    )  # served, absent
    # An invalid spec deactivates it (spec.active only).
    assert (
        asyncio.run(
            cluster.apply("default", Actions(workload_deactivate=True, workload_name="queued"))
        ).errors
        == []
    )
    wl = asyncio.run(cluster.read_workload("default", "queued"))[0]
    assert (
        wl is not None and wl["spec"]["active"] is False and wl["spec"]["podSets"][0]["count"] == 2
    )
    # Suspending patches `active` only (podSets are immutable in Kueue).
    assert (
        asyncio.run(cluster.apply("default", Actions(workload=_workload(suspend=True)))).errors
        == []
    )
    wl = asyncio.run(cluster.read_workload("default", "queued"))[0]
    assert (
        wl is not None
        and wl["spec"]["active"] is False
        and wl["spec"]["podSets"][0]["minCount"] == 1
    )
    # Written for an earlier spec (or queue) and holding no quota: podSets and queue rewritten.
    spec = FineTuneJobSpec.model_validate(quickstart_raw() | {"suspend": True})
    resized = build_workload(OWNER, spec, make_plan(3), "q2")
    assert (
        asyncio.run(
            cluster.apply("default", Actions(workload=resized, workload_rewrite=True))
        ).errors
        == []
    )
    wl = asyncio.run(cluster.read_workload("default", "queued"))[0]
    assert (
        wl is not None
        and wl["spec"]["podSets"][0]["count"] == 3
        and wl["spec"]["queueName"] == "q2"
    )
    asyncio.run(_create_flavor(cluster))
    asyncio.run(cluster.patch_workload_status("default", "queued", {"status": {
        "conditions": [{"type": t, "status": "True", "reason": t, "message": "", "lastTransitionTime": "2026-01-01T12:00:00Z"}
                       for t in ("QuotaReserved", "Admitted")],
        "admission": {"clusterQueue": "cq", "podSetAssignments": [
            {"name": "workers", "count": 2, "flavors": {"cpu": "spot", "memory": "spot"}}]}}}))  # fmt: skip
    wl = asyncio.run(cluster.read_workload("default", "queued"))[0]
    assert wl is not None and flavors_assigned(wl) == ["spot"]
    flavors = asyncio.run(cluster.read_flavors(["spot", "absent"]))
    assert set(flavors) == {"spot"}
    state = read_queue_state("q", wl, flavors)
    assert state.admitted_count == 2 and state.placement.node_selector == {"pool": "spot"}
    patch = finish_patch(wl, True, "done", datetime(2026, 1, 1, tzinfo=UTC))
    result = asyncio.run(
        cluster.apply("default", Actions(workload_status=patch, workload_name="queued"))
    )
    assert result.errors == []
    wl = asyncio.run(cluster.read_workload("default", "queued"))[0]
    assert wl is not None
    conds = {c["type"]: c["status"] for c in wl["status"]["conditions"]}
    assert conds == {"QuotaReserved": "True", "Admitted": "True", "Finished": "True"}


async def _create_flavor(cluster: ClusterApi) -> None:
    body = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "spot"},
            "spec": {"nodeLabels": {"pool": "spot"}}}  # fmt: skip
    await asyncio.to_thread(cluster.custom.create_cluster_custom_object, "kueue.x-k8s.io", "v1beta2",
                            "resourceflavors", body)  # fmt: skip


@pytest.fixture(scope="module")
def with_kueue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(
        tmp_path_factory.mktemp("api"), crds_dir=None, kubelet=False, kueue=True
    ) as local:
        yield local


def test_a_stale_status_patch_is_refused_and_not_an_error(with_kueue: LocalCluster) -> None:
    """The conditions list is replaced whole: a patch from an old read must not undo what
    Kueue wrote since (the resourceVersion it carries makes the server refuse it)."""
    server = with_kueue
    cluster = ClusterApi(config.new_client_from_config(config_file=str(server.kubeconfig_path)))
    owner = Owner(name="stale", namespace="default", uid=UID)
    spec = FineTuneJobSpec.model_validate(quickstart_raw())
    assert (
        asyncio.run(
            cluster.apply(
                "default", Actions(workload=build_workload(owner, spec, make_plan(2), "q"))
            )
        ).errors
        == []
    )
    read = asyncio.run(cluster.read_workload("default", "stale"))[0]
    assert read is not None
    evicted = {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "by Kueue",
               "lastTransitionTime": "2026-01-01T12:00:00Z"}  # fmt: skip
    asyncio.run(
        cluster.patch_workload_status("default", "stale", {"status": {"conditions": [evicted]}})
    )
    stale = finish_patch(read, True, "done", datetime(2026, 1, 1, tzinfo=UTC))
    result = asyncio.run(
        cluster.apply("default", Actions(workload_status=stale, workload_name="stale"))
    )
    assert result.errors == []
    now = asyncio.run(cluster.read_workload("default", "stale"))[0]
    assert now is not None and [c["type"] for c in now["status"]["conditions"]] == ["Evicted"]


def test_a_deleted_job_s_workload_waits_on_its_finalizer_until_the_operator_drops_it(
    with_kueue: LocalCluster,
) -> None:
    """Garbage collection of the Workload of a deleted job stops at Kueue's resource-in-use
    finalizer (as on a real API server) until the operator removes it (the job's delete
    handler, as Kueue's job reconciler once the job is gone): nothing hangs."""
    cluster = ClusterApi(config.new_client_from_config(config_file=str(with_kueue.kubeconfig_path)))
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gc-owner"}}
    made = cluster.core.create_namespaced_config_map("default", body)
    owner = Owner(name="gc", namespace="default", uid=made.metadata.uid)
    spec = FineTuneJobSpec.model_validate(quickstart_raw())
    wl = build_workload(owner, spec, make_plan(2), "q")
    assert asyncio.run(cluster.apply("default", Actions(workload=wl))).errors == []
    cluster.core.delete_namespaced_config_map("gc-owner", "default")  # the owner goes
    held, _ = asyncio.run(cluster.read_workload("default", "gc"))
    assert held is not None and held["metadata"].get("deletionTimestamp")
    assert held["metadata"]["finalizers"] == ["kueue.x-k8s.io/resource-in-use"]
    asyncio.run(cluster.release_workload("default", "gc", "another-job-uid"))  # not its own
    assert asyncio.run(cluster.read_workload("default", "gc"))[0] is not None
    asyncio.run(cluster.release_workload("default", "gc", owner.uid))
    assert asyncio.run(cluster.read_workload("default", "gc")) == (None, "")


def test_the_workload_handler_nudges_its_job_and_frees_an_orphan_s_finalizer(
    with_kueue: LocalCluster,
) -> None:
    """The Workload event handler: the owning job's pass is due at the next tick; a Workload
    being deleted whose job is gone (its delete handler missed) loses its finalizer."""
    import logging

    from finetune_operator.handlers import owner_job, workload_changed

    cluster = ClusterApi(config.new_client_from_config(config_file=str(with_kueue.kubeconfig_path)))
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "orphan-owner"}}
    made = cluster.core.create_namespaced_config_map("default", body)
    owner = Owner(name="orphan", namespace="default", uid=made.metadata.uid)
    spec = FineTuneJobSpec.model_validate(quickstart_raw())
    assert asyncio.run(cluster.apply("default", Actions(workload=build_workload(owner, spec, make_plan(2), "q")))).errors == []  # fmt: skip
    memo: dict[str, Any] = {"cluster": cluster, "nudged": {}}
    log = logging.getLogger("test")
    live = asyncio.run(cluster.read_workload("default", "orphan"))[0]
    assert live is not None and owner_job(live) is not None
    assert (
        owner_job({"metadata": {"ownerReferences": [{"kind": "Job", "apiVersion": "batch/v1"}]}})
        is None
    )
    asyncio.run(workload_changed(namespace="default", body=live, memo=memo, logger=log))
    assert set(memo["nudged"]) == {("default", "orphan")}
    assert asyncio.run(cluster.read_workload("default", "orphan"))[0] is not None  # not deleting
    cluster.core.delete_namespaced_config_map("orphan-owner", "default")  # collected: held
    held = asyncio.run(cluster.read_workload("default", "orphan"))[0]
    assert held is not None and held["metadata"].get("deletionTimestamp")
    memo["nudged"].clear()  # the job's timer took it
    asyncio.run(workload_changed(namespace="default", body=held, memo=memo, logger=log))
    assert asyncio.run(cluster.read_workload("default", "orphan")) == (None, "")
    # A gone job is not nudged: no timer would ever take its key (one left per deleted job).
    assert memo["nudged"] == {}
    asyncio.run(workload_changed(namespace="default", body=live, memo=memo, logger=log, type="DELETED"))  # fmt: skip
    assert memo["nudged"] == {}


def test_a_workload_written_without_the_finalizer_is_given_it(with_kueue: LocalCluster) -> None:
    """The adoption patch, as the API server takes it: added beside another finalizer; one
    from an old read (the list changed since) is refused, and the next pass redoes it."""
    from finetune_operator.reconcile.workload_patches import finalizer_adopt_patch

    cluster = ClusterApi(config.new_client_from_config(config_file=str(with_kueue.kubeconfig_path)))
    old = build_workload(Owner(name="old", namespace="default", uid=UID),
                         FineTuneJobSpec.model_validate(quickstart_raw()), make_plan(2), "q")  # fmt: skip
    old["metadata"]["finalizers"] = ["example.com/keep"]
    assert asyncio.run(cluster.apply("default", Actions(workload=old))).errors == []
    patch = finalizer_adopt_patch(asyncio.run(cluster.read_workload("default", "old"))[0] or {})
    assert patch is not None
    asyncio.run(cluster.patch_workload("default", "old", {"metadata": {"labels": {"x": "y"}}}))
    stale = asyncio.run(cluster.apply("default", Actions(workload_name="old", workload_finalizer=patch)))  # fmt: skip
    assert stale.errors == []  # 409: not an error, decided anew next pass
    assert asyncio.run(cluster.read_workload("default", "old"))[0]["metadata"]["finalizers"] == ["example.com/keep"]  # type: ignore[index]  # fmt: skip
    fresh = finalizer_adopt_patch(asyncio.run(cluster.read_workload("default", "old"))[0] or {})
    assert fresh is not None
    done = asyncio.run(cluster.apply("default", Actions(workload_name="old", workload_finalizer=fresh)))  # fmt: skip
    assert done.errors == []
    now = asyncio.run(cluster.read_workload("default", "old"))[0] or {}
    assert now["metadata"]["finalizers"] == ["example.com/keep", "kueue.x-k8s.io/resource-in-use"]
