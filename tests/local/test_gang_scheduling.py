"""The local cluster's gang schedulers: PodGroups served only when installed, and a group's
pods bound all at once or not at all (scheduler.place_gang, binding.py)."""

from __future__ import annotations

import contextlib
import pathlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from finetune_local.cluster import LocalCluster
from finetune_local.podgroups import GANG_SCHEDULERS, scheduler_for
from finetune_local.scheduler import place_gang
from tests.conftest import wait_until

COSCHEDULING = GANG_SCHEDULERS["coscheduling"]


def _node(name: str, pods: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {}},
        "status": {"allocatable": {"pods": str(pods)}},
    }


def _member(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"containers": [{"name": "c"}]}}


@pytest.mark.parametrize(
    ("free_slots", "pending", "bound", "min_member", "placed", "why"),
    [
        (2, 2, 0, 2, 2, ""),
        (1, 2, 0, 2, 0, "needs 2 pods at once and 1 fit"),
        (1, 1, 1, 2, 1, ""),  # a replacement joins a running group
        (3, 3, 0, 2, 3, ""),  # members above the minimum are placed when they fit
        (2, 3, 0, 2, 2, ""),
        (5, 1, 0, 2, 0, "fewer than its minMember 2"),
    ],
    ids=["fits", "half-fits", "replacement", "above-minimum", "minimum-of-more", "too-few-pods"],
)
def test_place_gang_is_all_or_nothing(
    free_slots: int, pending: int, bound: int, min_member: int, placed: int, why: str
) -> None:
    nodes = [_node(f"n{i}", 1) for i in range(free_slots)]
    pods = [_member(f"w{i}") for i in range(pending)]
    chosen, message = place_gang(pods, bound, min_member, nodes, {})
    assert len(chosen) == placed
    assert len(set(chosen.values())) == len(chosen)  # one slot per node: never two on one
    assert why in message
    if placed == 0:
        assert message


# ---------------------------------------------------------------- real API objects + kubelet


@pytest.fixture(scope="module")
def gang_cluster(
    crds_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    """3 nodes of one pod each, Coscheduling installed beside the default scheduler."""
    with LocalCluster(
        tmp_path_factory.mktemp("gang"),
        crds_dir=crds_dir,
        nodes=3,
        node_capacity={"pods": "1"},
        gang_schedulers=["coscheduling"],
    ) as local:
        yield local


def _pod(
    name: str, group: str | None, seconds: float, scheduler: str = COSCHEDULING.name
) -> dict[str, Any]:
    labels = {"app": name, **({COSCHEDULING.pod_label or "": group} if group else {})}
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "schedulerName": scheduler,
            "containers": [
                {"name": "main", "image": "ignored", "command": ["sh", "-c", f"sleep {seconds}"]}
            ],
        },
    }


def _pod_group(name: str, min_member: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{COSCHEDULING.group}/{COSCHEDULING.version}",
        "kind": "PodGroup",
        "metadata": {"name": name},
        "spec": {"minMember": min_member},
    }


def _custom(
    cluster: LocalCluster, new_api_client: Callable[[LocalCluster], Any]
) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(new_api_client(cluster))


@pytest.mark.slow
def test_a_group_that_does_not_fit_binds_no_pod_until_it_does(
    gang_cluster: LocalCluster, new_api_client: Callable[[LocalCluster], Any]
) -> None:
    core = client.CoreV1Api(new_api_client(gang_cluster))
    custom = _custom(gang_cluster, new_api_client)
    tag = uuid.uuid4().hex[:5]
    first, second = f"a-{tag}", f"b-{tag}"
    for group in (first, second):
        custom.create_namespaced_custom_object(
            COSCHEDULING.group, COSCHEDULING.version, "default", "podgroups", _pod_group(group, 2)
        )
    # Group a takes 2 of the 3 one-pod nodes; group b's 2 pods would fit only one by one.
    for i in range(2):
        core.create_namespaced_pod("default", _pod(f"{first}-{i}", first, 4))
    wait_until(
        lambda: all(
            core.read_namespaced_pod(f"{first}-{i}", "default").spec.node_name for i in range(2)
        ),
        "group a bound",
        30,
    )
    for i in range(2):
        core.create_namespaced_pod("default", _pod(f"{second}-{i}", second, 0))

    def unschedulable() -> list[Any] | None:
        pods = [core.read_namespaced_pod(f"{second}-{i}", "default") for i in range(2)]
        conds = [
            next((c for c in p.status.conditions or [] if c.type == "PodScheduled"), None)
            for p in pods
        ]
        return conds if all(c is not None and c.reason == "Unschedulable" for c in conds) else None

    conds = wait_until(unschedulable, "group b reported unschedulable", 30)
    assert "needs 2 pods at once and 1 fit" in conds[0].message
    assert all(
        core.read_namespaced_pod(f"{second}-{i}", "default").spec.node_name is None
        for i in range(2)
    )
    # Group a's pods finish and free their nodes: group b is placed whole.
    done = wait_until(
        lambda: all(
            core.read_namespaced_pod(f"{second}-{i}", "default").status.phase == "Succeeded"
            for i in range(2)
        ),
        "group b ran",
        60,
    )
    assert done
    nodes = {core.read_namespaced_pod(f"{second}-{i}", "default").spec.node_name for i in range(2)}
    assert len(nodes) == 2


@pytest.mark.slow
def test_default_scheduler_would_split_the_group_and_unknown_scheduler_never_binds(
    gang_cluster: LocalCluster, new_api_client: Callable[[LocalCluster], Any]
) -> None:
    """The control: the same pods under default-scheduler bind one by one (the half-placed
    group gang scheduling prevents), and a pod naming a scheduler that is not running stays
    Pending with no condition, as on a real cluster."""
    core = client.CoreV1Api(new_api_client(gang_cluster))
    tag = uuid.uuid4().hex[:5]
    # Every pod here runs until deleted: a pod that ended would free its slot and let the
    # second member bind too (the race this test once lost with `sleep 0` members).
    names = [f"hold-{tag}", f"hold2-{tag}", f"lost-{tag}", f"solo-{tag}-0", f"solo-{tag}-1"]
    try:
        core.create_namespaced_pod("default", _pod(names[0], None, 600, "default-scheduler"))
        core.create_namespaced_pod("default", _pod(names[1], None, 600, "default-scheduler"))
        wait_until(
            lambda: core.read_namespaced_pod(names[1], "default").spec.node_name, "hold bound", 30
        )
        core.create_namespaced_pod("default", _pod(names[2], None, 600, "no-such-scheduler"))
        for i in range(2):
            core.create_namespaced_pod(
                "default", _pod(f"solo-{tag}-{i}", f"g-{tag}", 600, "default-scheduler")
            )

        def solo_bound() -> list[int]:
            return [
                i
                for i in range(2)
                if core.read_namespaced_pod(f"solo-{tag}-{i}", "default").spec.node_name
            ]

        # One slot left: default-scheduler ignores the group label and binds one of the two.
        wait_until(lambda: solo_bound() or None, "one solo pod bound", 30)
        time.sleep(2)  # a few scheduling passes: the other stays Pending, there is no room
        assert len(solo_bound()) == 1
        lost = core.read_namespaced_pod(names[2], "default")
        assert lost.spec.node_name is None and not lost.status.conditions
    finally:
        for name in names:
            with contextlib.suppress(ApiException):
                core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


@pytest.mark.slow
def test_podgroups_are_served_only_where_the_scheduler_is_installed(
    gang_cluster: LocalCluster,
    api_cluster: LocalCluster,
    new_api_client: Callable[[LocalCluster], Any],
) -> None:
    installed = _custom(gang_cluster, new_api_client)
    created = installed.create_namespaced_custom_object(
        COSCHEDULING.group,
        COSCHEDULING.version,
        "default",
        "podgroups",
        {
            **_pod_group(f"pg-{uuid.uuid4().hex[:5]}", 3),
            "spec": {"minMember": 3, "unknownField": 1},
        },
    )
    assert created["spec"] == {"minMember": 3}  # pruned, as a structural schema does
    missing = _custom(api_cluster, new_api_client)
    with pytest.raises(ApiException) as err:
        missing.create_namespaced_custom_object(
            COSCHEDULING.group, COSCHEDULING.version, "default", "podgroups", _pod_group("pg", 2)
        )
    assert err.value.status == 404


@pytest.mark.parametrize(
    ("scheduler", "meta", "group"),
    [
        ("coscheduling", {"labels": {"scheduling.x-k8s.io/pod-group": "g"}}, "g"),
        ("coscheduling", {"annotations": {"scheduling.k8s.io/group-name": "g"}}, None),
        ("volcano", {"annotations": {"scheduling.k8s.io/group-name": "g"}}, "g"),
        ("volcano", {"labels": {"scheduling.x-k8s.io/pod-group": "g"}}, None),
    ],
    ids=[
        "coscheduling-label",
        "coscheduling-ignores-annotation",
        "volcano-annotation",
        "volcano-ignores-label",
    ],
)
def test_each_scheduler_reads_its_own_membership(
    scheduler: str, meta: dict[str, Any], group: str | None
) -> None:
    gang = GANG_SCHEDULERS[scheduler]
    pod = {"metadata": meta, "spec": {"schedulerName": gang.name}}
    assert scheduler_for(pod, list(GANG_SCHEDULERS.values())) is gang
    assert gang.group_of(pod) == group
    assert scheduler_for({"metadata": meta, "spec": {}}, list(GANG_SCHEDULERS.values())) is None


@pytest.mark.slow
def test_a_member_bound_to_a_node_that_is_gone_does_not_count_as_bound(
    gang_cluster: LocalCluster, new_api_client: Callable[[LocalCluster], Any]
) -> None:
    """Coscheduling counts the members on the nodes it knows: one bound to a deleted node
    (not yet collected) runs nowhere, so a lone new member of a 2-pod gang is not placed."""
    core = client.CoreV1Api(new_api_client(gang_cluster))
    group = f"gone-{uuid.uuid4().hex[:5]}"
    _custom(gang_cluster, new_api_client).create_namespaced_custom_object(
        COSCHEDULING.group, COSCHEDULING.version, "default", "podgroups", _pod_group(group, 2)
    )
    orphan = _pod(f"{group}-orphan", group, 0)
    orphan["spec"]["nodeName"] = "a-deleted-node"
    core.create_namespaced_pod("default", orphan)
    core.create_namespaced_pod("default", _pod(f"{group}-0", group, 0))

    def condition() -> Any:
        pod = core.read_namespaced_pod(f"{group}-0", "default")
        return next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)

    cond = wait_until(condition, "the new member's PodScheduled condition", 30)
    assert cond.reason == "Unschedulable"
    assert "the pod group has 1 pods, fewer than its minMember 2" in cond.message
    assert core.read_namespaced_pod(f"{group}-0", "default").spec.node_name is None
    for name in (f"{group}-orphan", f"{group}-0"):
        core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
