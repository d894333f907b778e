"""The control plane's answer to a node that stops answering, against the local API server:
DefaultTolerationSeconds admission, the node lifecycle controller (Unknown, taints, pods not
Ready), the taint eviction controller and PodGC. Each controller pass is driven by hand with
its clock (`now`) given, on an API server without a kubelet."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from finetune_local.apiadmission import add_default_toleration_seconds
from finetune_local.cluster import LocalCluster
from finetune_local.nodelifecycle import (
    NodeLifecycleController,
    unknown_conditions,
    wanted_taints,
)
from finetune_local.nodes import micro_time
from finetune_local.podgc import PodGC
from finetune_local.restclient import RestClient
from finetune_local.tainteviction import TaintEvictionController, eviction_due

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
UNREACHABLE, NOT_READY = "node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"


def _at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def _stamp(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _tol(key: str = UNREACHABLE, seconds: int | None = None, **extra: Any) -> dict[str, Any]:
    tol: dict[str, Any] = {"key": key, "operator": "Exists", "effect": "NoExecute", **extra}
    if seconds is not None:
        tol["tolerationSeconds"] = seconds
    return tol


# --------------------------------------------------------------------------- pure rules


@pytest.mark.parametrize(
    ("own", "added"),
    [
        ([], [NOT_READY, UNREACHABLE]),
        ([_tol(UNREACHABLE, 60)], [NOT_READY]),
        ([_tol(UNREACHABLE)], [NOT_READY]),  # no seconds: tolerated for ever, still its own
        ([{"operator": "Exists"}], []),  # tolerates every taint
        ([{"key": UNREACHABLE, "operator": "Exists"}], [NOT_READY]),  # no effect: all effects
        ([_tol(NOT_READY, 5, effect="NoSchedule")], [NOT_READY, UNREACHABLE]),  # not NoExecute
        # Kubernetes' test is the key and effect only: an Equal toleration of another value
        # still counts as the pod's own.
        (
            [{"key": UNREACHABLE, "operator": "Equal", "value": "x", "effect": "NoExecute"}],
            [NOT_READY],
        ),
    ],
    ids=["none", "own-seconds", "own-forever", "wildcard", "no-effect", "noschedule", "equal"],
)
def test_default_toleration_seconds(own: list[dict[str, Any]], added: list[str]) -> None:
    spec: dict[str, Any] = {"tolerations": [dict(t) for t in own]}
    add_default_toleration_seconds(spec)
    assert spec["tolerations"][: len(own)] == own
    assert spec["tolerations"][len(own) :] == [_tol(k, 300) for k in added]


@pytest.mark.parametrize(
    ("ready", "before", "after"),
    [
        ("Unknown", [], [(UNREACHABLE, "NoSchedule"), (UNREACHABLE, "NoExecute")]),
        ("False", [], [(NOT_READY, "NoSchedule"), (NOT_READY, "NoExecute")]),
        ("True", [(UNREACHABLE, "NoSchedule"), (UNREACHABLE, "NoExecute")], []),
        # Ready False -> Unknown swaps the keys; an admin's taint stays.
        ("Unknown", [("gpu", "NoSchedule"), (NOT_READY, "NoExecute")],
         [("gpu", "NoSchedule"), (UNREACHABLE, "NoSchedule"), (UNREACHABLE, "NoExecute")]),
    ],
    ids=["unknown", "false", "ready-again", "swap"],
)  # fmt: skip
def test_taints_follow_ready(
    ready: str, before: list[tuple[str, str]], after: list[tuple[str, str]]
) -> None:
    taints = wanted_taints([{"key": k, "effect": e} for k, e in before], ready, "STAMP")
    assert [(t["key"], t["effect"]) for t in taints] == after
    for taint in taints:  # only the controller's own NoExecute taints carry timeAdded
        added = taint["key"] in (UNREACHABLE, NOT_READY) and taint["effect"] == "NoExecute"
        assert ("timeAdded" in taint) == (added and (taint["key"], "NoExecute") not in before)


def test_an_existing_taint_keeps_its_time_added() -> None:
    kept = {"key": UNREACHABLE, "effect": "NoExecute", "timeAdded": "EARLIER"}
    taints = wanted_taints([kept], "Unknown", "NOW")
    assert kept in taints


def test_unknown_keeps_the_last_heartbeat() -> None:
    ready = {"type": "Ready", "status": "True", "lastHeartbeatTime": "BEAT", "reason": "KubeletReady"}  # fmt: skip
    (cond,) = unknown_conditions([ready], "NOW") or []
    assert cond == {
        "type": "Ready",
        "status": "Unknown",
        "reason": "NodeStatusUnknown",
        "message": "Kubelet stopped posting node status.",
        "lastHeartbeatTime": "BEAT",
        "lastTransitionTime": "NOW",
    }
    assert unknown_conditions([cond], "LATER") is None  # already Unknown: nothing to write


@pytest.mark.parametrize(
    ("tolerations", "due"),
    [
        ([], 0.0),  # not tolerated: at once
        ([_tol(UNREACHABLE, 60)], 60.0),
        ([_tol(UNREACHABLE)], None),  # no seconds: never
        ([_tol(UNREACHABLE, 0)], 0.0),
        ([_tol(UNREACHABLE, -5)], 0.0),
        # The least seconds among the tolerations used; one without seconds does not lift it.
        ([_tol(UNREACHABLE, 60), {"operator": "Exists"}], 60.0),
        ([_tol(UNREACHABLE, 60), _tol(UNREACHABLE, 20)], 20.0),
        ([_tol(NOT_READY, 20)], 0.0),  # another key's toleration does not cover it
    ],
    ids=["none", "seconds", "forever", "zero", "negative", "min-with-wildcard", "min", "other-key"],
)
def test_eviction_due(tolerations: list[dict[str, Any]], due: float | None) -> None:
    pod = {"spec": {"tolerations": tolerations}}
    taints = [{"key": UNREACHABLE, "effect": "NoExecute"}]
    expected = None if due is None else _at(10 + due)
    assert eviction_due(pod, taints, [_at(10)]) == expected
    assert eviction_due(pod, [], []) is None


def test_eviction_counts_from_the_earliest_taint() -> None:
    pod = {"spec": {"tolerations": [_tol(UNREACHABLE, 30), _tol(NOT_READY, 30)]}}
    taints = [{"key": NOT_READY, "effect": "NoExecute"}, {"key": UNREACHABLE, "effect": "NoExecute"}]  # fmt: skip
    assert eviction_due(pod, taints, [_at(20), _at(5)]) == _at(35)


# --------------------------------------------------------------------------- against the API


class Api:
    """A RestClient on the cluster's loop, and the controllers' passes run there."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.client = RestClient(cluster.api_url)
        cluster.run(self.client.__aenter__())

    def close(self) -> None:
        self.cluster.run(self.client.__aexit__(None, None, None))

    def get(self, path: str) -> Any:
        return self.cluster.run(self.client.get(path))


@pytest.fixture
def api(api_cluster: LocalCluster) -> Iterator[Api]:
    rest = Api(api_cluster)
    yield rest
    rest.close()


@pytest.fixture
def core(api_cluster: LocalCluster, new_api_client: Any) -> client.CoreV1Api:
    return client.CoreV1Api(new_api_client(api_cluster))


def _node(core: client.CoreV1Api, ready: str = "True", taints: list[dict[str, Any]] | None = None) -> str:  # fmt: skip
    name = f"node-{uuid.uuid4().hex[:6]}"
    core.create_node({"metadata": {"name": name}, "spec": {"taints": taints or None}})
    cond = {"type": "Ready", "status": ready, "reason": "KubeletReady",
            "lastHeartbeatTime": _stamp(T0), "lastTransitionTime": _stamp(T0)}  # fmt: skip
    core.patch_node_status(name, {"status": {"conditions": [cond]}})
    return name


def _lease(api_cluster: LocalCluster, new_api_client: Any, node: str) -> None:
    leases = client.CoordinationV1Api(new_api_client(api_cluster))
    body = {"metadata": {"name": node}, "spec": {"holderIdentity": node, "renewTime": micro_time()}}  # fmt: skip
    try:
        leases.replace_namespaced_lease(node, "kube-node-lease", body)
    except client.ApiException:
        leases.create_namespaced_lease("kube-node-lease", body)


def _pod(core: client.CoreV1Api, node: str, tolerations: list[dict[str, Any]] | None = None, ready: bool = True) -> str:  # fmt: skip
    name = f"pod-{uuid.uuid4().hex[:6]}"
    spec = {"nodeName": node, "containers": [{"name": "m", "image": "x"}], "tolerations": tolerations}  # fmt: skip
    core.create_namespaced_pod("default", {"metadata": {"name": name}, "spec": spec})
    conds = [{"type": "Ready", "status": "True" if ready else "False"}]
    core.patch_namespaced_pod_status(name, "default", {"status": {"phase": "Running", "conditions": conds}})  # fmt: skip
    return name


def _ready_of(obj: Any) -> str:
    return next(c.status for c in obj.status.conditions if c.type == "Ready")


def test_created_pods_get_the_default_tolerations(core: client.CoreV1Api) -> None:
    node = _node(core)
    pod = core.read_namespaced_pod(_pod(core, node, [_tol(UNREACHABLE, 7)]), "default")
    assert [(t.key, t.toleration_seconds) for t in pod.spec.tolerations] == [
        (UNREACHABLE, 7),
        (NOT_READY, 300),
    ]


def test_a_silent_node_goes_unknown_tainted_and_its_pods_not_ready_then_back(
    api_cluster: LocalCluster, api: Api, core: client.CoreV1Api, new_api_client: Any
) -> None:
    node, other = _node(core), _node(core)
    for name in (node, other):
        _lease(api_cluster, new_api_client, name)
    pod, elsewhere = _pod(core, node), _pod(core, other)
    controller = NodeLifecycleController(api.client, grace=40, period=5)

    def monitor(seconds: float) -> None:
        api_cluster.run(controller.monitor(_at(seconds)))

    monitor(0)  # first sight of both heartbeats
    _lease(api_cluster, new_api_client, other)  # only `other` heartbeats from now on
    monitor(30)
    _lease(api_cluster, new_api_client, other)
    monitor(40)  # 40 s without a change is not yet past the grace
    assert _ready_of(core.read_node(node)) == "True"
    _lease(api_cluster, new_api_client, other)
    monitor(41)
    lost = core.read_node(node)
    ready = next(c for c in lost.status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("Unknown", "NodeStatusUnknown")
    assert ready.last_transition_time == _at(41)
    assert [(t.key, t.effect, t.time_added) for t in lost.spec.taints] == [
        (UNREACHABLE, "NoSchedule", None),
        (UNREACHABLE, "NoExecute", _at(41)),
    ]
    assert _ready_of(core.read_namespaced_pod(pod, "default")) == "False"
    assert _ready_of(core.read_node(other)) == "True" and not core.read_node(other).spec.taints
    assert _ready_of(core.read_namespaced_pod(elsewhere, "default")) == "True"

    # The kubelet is back: its lease renewed and Ready posted; the taints go.
    _lease(api_cluster, new_api_client, node)
    cond = {"type": "Ready", "status": "True", "reason": "KubeletReady",
            "lastHeartbeatTime": _stamp(_at(50)), "lastTransitionTime": _stamp(_at(50))}  # fmt: skip
    core.patch_node_status(node, {"status": {"conditions": [cond]}})
    monitor(51)
    assert _ready_of(core.read_node(node)) == "True"
    assert not core.read_node(node).spec.taints


def test_taint_eviction_deletes_as_the_tolerations_say(
    api_cluster: LocalCluster, api: Api, core: client.CoreV1Api
) -> None:
    taint = {"key": UNREACHABLE, "effect": "NoExecute", "timeAdded": _stamp(_at(0))}
    node = _node(core, "Unknown", [taint])
    stays = _pod(core, node, [_tol(UNREACHABLE)])  # no seconds: tolerated for ever
    later = _pod(core, node, [_tol(UNREACHABLE, 30)])
    # The API server's 300 s are its only toleration of `unreachable`.
    default = _pod(core, node)
    controller = TaintEvictionController(api.client, period=1)

    def deleted(name: str) -> bool:
        return core.read_namespaced_pod(name, "default").metadata.deletion_timestamp is not None

    api_cluster.run(controller.evict(_at(29)))
    assert not any(deleted(p) for p in (stays, later, default))
    api_cluster.run(controller.evict(_at(30)))
    assert deleted(later) and not deleted(stays) and not deleted(default)
    pod = core.read_namespaced_pod(later, "default")
    target = next(c for c in pod.status.conditions if c.type == "DisruptionTarget")
    assert (target.status, target.reason) == ("True", "DeletionByTaintManager")
    # Graceful: Terminating, for its grace period, until a kubelet confirms it (none will).
    assert pod.metadata.deletion_grace_period_seconds == 30
    api_cluster.run(controller.evict(_at(300)))
    assert deleted(default) and not deleted(stays)
    untolerated = _pod(core, node, [{"key": "other", "operator": "Exists"}])
    # Its admission gave it 300 s of unreachable: tolerated until then.
    api_cluster.run(controller.evict(_at(299)))
    assert not deleted(untolerated)


def test_a_pod_not_tolerating_a_no_execute_taint_is_evicted_at_once(
    api_cluster: LocalCluster, api: Api, core: client.CoreV1Api
) -> None:
    node = _node(core, "True", [{"key": "dedicated", "value": "x", "effect": "NoExecute"}])
    pod = _pod(core, node)
    controller = TaintEvictionController(api.client, period=1)
    api_cluster.run(controller.evict(_at(0)))  # no timeAdded: counted from first sight
    assert core.read_namespaced_pod(pod, "default").metadata.deletion_timestamp is not None


def _gone(core: client.CoreV1Api, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, "default")
    except client.ApiException as err:
        return err.status == 404
    return False


def test_pod_gc_force_deletes_pods_of_a_deleted_node_after_the_quarantine(
    api_cluster: LocalCluster, api: Api, core: client.CoreV1Api
) -> None:
    node = _node(core)
    pod = _pod(core, node)
    core.delete_namespaced_pod(pod, "default")  # graceful: Terminating (no kubelet)
    core.delete_node(node)
    gc = PodGC(api.client, period=20, quarantine=40)
    api_cluster.run(gc.collect(_at(0)))
    api_cluster.run(gc.collect(_at(39)))
    assert not _gone(core, pod)
    api_cluster.run(gc.collect(_at(40)))
    assert _gone(core, pod)


def test_pod_gc_force_deletes_terminating_pods_of_an_out_of_service_node(
    api_cluster: LocalCluster, api: Api, core: client.CoreV1Api
) -> None:
    out = {"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute"}  # fmt: skip
    node = _node(core, "Unknown", [out])
    terminating, running = _pod(core, node, [{"operator": "Exists"}]), _pod(core, node, [{"operator": "Exists"}])  # fmt: skip
    core.delete_namespaced_pod(terminating, "default")
    ready_node = _node(core, "True", [out])  # Ready: the admin's taint alone is not enough
    kept = _pod(core, ready_node, [{"operator": "Exists"}])
    core.delete_namespaced_pod(kept, "default")
    api_cluster.run(PodGC(api.client, period=20, quarantine=40).collect(_at(0)))
    assert _gone(core, terminating)
    assert not _gone(core, running) and not _gone(core, kept)
