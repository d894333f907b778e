"""The local scheduler's NodeResourcesFit (resourcefit.py, scheduler.py), the node's
allocatable (nodes.py) and the API server's request defaulting, validation and QoS class
(podresources.py): pure, quick."""

from __future__ import annotations

from typing import Any

import pytest

from finetune_local.apistore import ApiError
from finetune_local.nodes import DEFAULT_CAPACITY, check_node_resources, node_allocatable
from finetune_local.podresources import default_requests, qos_class, resource_errors
from finetune_local.resourcefit import amount, insufficient, pod_requests
from finetune_local.scheduler import fit_error, pick_node


def _container(requests: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"name": "c", "resources": {"requests": requests or {}}, **extra}


def _pod(
    *containers: dict[str, Any],
    init: list[dict[str, Any]] | None = None,
    overhead: dict[str, str] | None = None,
    phase: str = "Running",
    name: str = "p",
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers)}
    if init:
        spec["initContainers"] = init
    if overhead:
        spec["overhead"] = overhead
    return {"metadata": {"name": name}, "spec": spec, "status": {"phase": phase}}


def _node(name: str, **allocatable: str) -> dict[str, Any]:
    allocatable.setdefault("pods", "110")
    return {"metadata": {"name": name, "labels": {}}, "status": {"allocatable": allocatable}}


def test_quantities_are_counted_in_the_schedulers_units() -> None:
    assert amount("cpu", "1.5") == 1500
    assert amount("cpu", "250m") == 250
    assert amount("cpu", "0.1m") == 1  # rounded up, as Kubernetes rounds a request
    assert amount("memory", "2Gi") == 2 * 2**30
    assert amount("memory", "1G") == 10**9
    assert amount("ephemeral-storage", "1e3") == 1000
    with pytest.raises(ValueError, match="'2Gx' is not a Kubernetes quantity"):
        amount("memory", "2Gx")


def test_request_sums_containers_and_takes_the_largest_init_container_plus_overhead() -> None:
    pod = _pod(
        _container({"cpu": "500m", "memory": "1Gi"}),
        _container({"cpu": "250m", "nvidia.com/gpu": "1"}),
        init=[_container({"cpu": "2", "memory": "256Mi"}), _container({"memory": "3Gi"})],
        overhead={"cpu": "100m", "memory": "64Mi"},
    )
    assert pod_requests(pod) == {
        "cpu": 2000 + 100,  # the largest init container beats the containers' 750m
        "memory": 3 * 2**30 + 64 * 2**20,  # likewise 3Gi over the containers' 1Gi
        "nvidia.com/gpu": 1,
    }


def test_a_sidecar_runs_beside_later_init_containers_and_the_app() -> None:
    sidecar = _container({"cpu": "300m"}, restartPolicy="Always")
    pod = _pod(_container({"cpu": "500m"}), init=[sidecar, _container({"cpu": "600m"})])
    # the later init container needs 600m beside the sidecar's 300m; the app 500m + 300m
    assert pod_requests(pod) == {"cpu": 900}


@pytest.mark.parametrize(
    ("requests", "reasons"),
    [
        ({"cpu": "3"}, []),
        ({"cpu": "3100m"}, ["Insufficient cpu"]),
        ({"memory": "7Gi"}, []),  # exactly what is left
        ({"memory": "7169Mi"}, ["Insufficient memory"]),
        ({"ephemeral-storage": "33Gi"}, ["Insufficient ephemeral-storage"]),
        ({"nvidia.com/gpu": "2"}, ["Insufficient nvidia.com/gpu"]),
        ({"example.com/fpga": "1"}, ["Insufficient example.com/fpga"]),  # not advertised
        ({"cpu": "4", "memory": "8Gi"}, ["Insufficient cpu", "Insufficient memory"]),
    ],
)
def test_a_node_fits_what_its_allocatable_leaves_after_its_pods(
    requests: dict[str, str], reasons: list[str]
) -> None:
    allocatable = {
        "cpu": "4",
        "memory": "8Gi",
        "ephemeral-storage": "64Gi",
        "nvidia.com/gpu": "2",
        "pods": "10",
    }
    running = _pod(
        _container(
            {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "32Gi", "nvidia.com/gpu": "1"}
        )
    )
    assert insufficient(_pod(_container(requests)), allocatable, [running]) == reasons


def test_ended_pods_free_their_requests_and_their_pod_slot() -> None:
    allocatable = {"cpu": "2", "pods": "1"}
    big = _container({"cpu": "2"})
    assert insufficient(_pod(big), allocatable, [_pod(big, phase="Succeeded")]) == []
    assert insufficient(_pod(big), allocatable, [_pod(big, phase="Failed")]) == []
    assert insufficient(_pod(big), allocatable, [_pod(big, phase="Pending")]) == [
        "Too many pods",
        "Insufficient cpu",
    ]


def test_a_pod_that_requests_nothing_needs_only_a_pod_slot() -> None:
    full = [_pod(_container({"cpu": "4"}))]
    assert insufficient(_pod(_container()), {"cpu": "4", "pods": "2"}, full) == []
    assert insufficient(_pod(_container()), {"cpu": "4", "pods": "1"}, full) == ["Too many pods"]


def test_pick_node_counts_each_nodes_shortfalls_in_kubes_message() -> None:
    nodes = [
        _node("small", cpu="1", memory="64Gi"),
        _node("lean-a", cpu="16", memory="2Gi"),
        _node("lean-b", cpu="16", memory="2Gi"),
    ]
    pod = _pod(_container({"cpu": "2", "memory": "4Gi"}))
    node, message = pick_node(pod, nodes, {})
    assert node is None
    assert message == "0/3 nodes are available: 1 Insufficient cpu, 2 Insufficient memory."
    both = pick_node(_pod(_container({"cpu": "32", "memory": "128Gi"})), nodes, {})
    assert both == (None, "0/3 nodes are available: 3 Insufficient cpu, 3 Insufficient memory.")
    assert pick_node(_pod(_container({"cpu": "2", "memory": "1Gi"})), nodes, {})[0] == "lean-a"
    assert fit_error(0, {}) == "no nodes available to schedule pods"


def test_pick_node_sees_what_is_bound_to_each_node() -> None:
    nodes = [_node("a", cpu="2"), _node("b", cpu="2")]
    busy = _pod(_container({"cpu": "1500m"}), name="busy")
    pod = _pod(_container({"cpu": "1"}))
    assert pick_node(pod, nodes, {"a": [busy]})[0] == "b"
    assert pick_node(pod, nodes, {"a": [busy], "b": [busy]}) == (
        None,
        "0/2 nodes are available: 2 Insufficient cpu.",
    )


def test_allocatable_keeps_back_the_kubelets_hard_eviction_thresholds() -> None:
    allocatable = node_allocatable(DEFAULT_CAPACITY)
    assert allocatable["cpu"] == "8" and allocatable["pods"] == "110"
    assert int(allocatable["memory"]) == 32 * 2**30 - 100 * 2**20
    assert int(allocatable["ephemeral-storage"]) == 180 * 2**30  # 10% kept back
    assert node_allocatable({"nvidia.com/gpu": "8"}) == {"nvidia.com/gpu": "8"}


def test_bad_node_resources_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"node_capacity\['memory'\]: quantity 'lots'"):
        check_node_resources(["n0"], {"memory": "lots"}, {})
    with pytest.raises(ValueError, match=r"node_resources names no such node: \['n9'\]"):
        check_node_resources(["n0"], {}, {"n9": {"cpu": "1"}})


def test_a_limit_without_a_request_becomes_the_request() -> None:
    spec: dict[str, Any] = {
        "initContainers": [{"name": "i", "resources": {"limits": {"cpu": "1"}}}],
        "containers": [
            {
                "name": "c",
                "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "2", "memory": "1Gi"}},
            }
        ],
    }
    default_requests(spec)
    assert spec["initContainers"][0]["resources"]["requests"] == {"cpu": "1"}
    assert spec["containers"][0]["resources"]["requests"] == {"cpu": "1", "memory": "1Gi"}
    assert qos_class(spec) == "Burstable"
    with pytest.raises(ApiError, match=r"spec.containers\[0\].resources.limits\[memory\]"):
        default_requests({"containers": [{"resources": {"limits": {"memory": "2Gx"}}}]})


@pytest.mark.parametrize(
    ("resources", "qos"),
    [
        ({}, "BestEffort"),
        ({"limits": {"cpu": "1", "memory": "1Gi"}}, "Guaranteed"),
        (
            {
                "requests": {"cpu": "1000m", "memory": "1Gi"},
                "limits": {"cpu": "1", "memory": "1Gi"},
            },
            "Guaranteed",
        ),
        ({"requests": {"memory": "1Gi"}}, "Burstable"),
        ({"limits": {"nvidia.com/gpu": "1"}}, "BestEffort"),
        ({"requests": {"cpu": "0", "memory": "0"}}, "BestEffort"),  # zero is no request
        ({"requests": {"cpu": "0"}, "limits": {"cpu": "1", "memory": "1Gi"}}, "Burstable"),
        ({"limits": {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "1"}}, "Guaranteed"),
        ({"limits": {"cpu": "1", "memory": "0"}}, "Burstable"),
    ],
)
def test_qos_class(resources: dict[str, Any], qos: str) -> None:
    spec = {"containers": [{"name": "c", "resources": resources}]}
    default_requests(spec)
    assert qos_class(spec) == qos


def test_a_resource_the_pod_does_not_request_is_not_checked_on_an_overcommitted_node() -> None:
    """kube-scheduler's fitsRequest checks cpu, memory and ephemeral-storage only when the pod
    requests more than zero of each: a node whose cpu is already over-committed (a pod bound
    by nodeName, an allocatable that shrank) still takes a pod that asks for memory only."""
    node = {"cpu": "1", "memory": "4Gi", "pods": "10"}
    over = [_pod(_container({"cpu": "2"}), name="bound-by-name")]
    assert insufficient(_pod(_container({"memory": "1Gi"})), node, over) == []
    assert insufficient(_pod(_container({"cpu": "1m", "memory": "1Gi"})), node, over) == [
        "Insufficient cpu"
    ]


def test_a_node_that_advertises_no_pod_count_takes_no_pod() -> None:
    """kube-scheduler reads a missing ``allocatable.pods`` as 0, as any resource not listed."""
    assert insufficient(_pod(_container()), {"cpu": "4"}, []) == ["Too many pods"]
    bare = {"metadata": {"name": "bare", "labels": {}}, "status": {"allocatable": {"cpu": "4"}}}
    assert pick_node(_pod(_container()), [bare], {}) == (
        None,
        "0/1 nodes are available: 1 Too many pods.",
    )


def _guaranteed() -> dict[str, Any]:
    return {"name": "c", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}


def test_qos_class_counts_init_containers() -> None:
    """Guaranteed needs every container, init ones included, to limit cpu and memory."""
    spec: dict[str, Any] = {
        "initContainers": [{"name": "i", "resources": {"limits": {"cpu": "1"}}}],
        "containers": [_guaranteed()],
    }
    default_requests(spec)
    assert qos_class(spec) == "Burstable"
    both: dict[str, Any] = {"initContainers": [_guaranteed()], "containers": [_guaranteed()]}
    default_requests(both)
    assert qos_class(both) == "Guaranteed"
    best: dict[str, Any] = {
        "initContainers": [{"name": "i", "resources": {"requests": {"memory": "1Mi"}}}],
        "containers": [{"name": "c"}],
    }
    assert qos_class(best) == "Burstable"


@pytest.mark.parametrize(
    ("resources", "errors"),
    [
        ({"requests": {"cpu": "1"}, "limits": {"cpu": "2"}}, []),
        (
            {"requests": {"cpu": "-1"}},
            [("requests[cpu]", 'Invalid value: "-1": must be greater than or equal to 0')],
        ),
        (
            {"limits": {"memory": "-1Gi"}, "requests": {"memory": "1Gi"}},
            [
                ("limits[memory]", 'Invalid value: "-1Gi": must be greater than or equal to 0'),
                # the API server compares the request with the limit all the same
                (
                    "requests[memory]",
                    'Invalid value: "1Gi": must be less than or equal to memory limit of -1Gi',
                ),
            ],
        ),
        (
            {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}},
            [
                (
                    "requests[cpu]",
                    'Invalid value: "2": must be less than or equal to cpu limit of 1500m',
                )
            ],
        ),
        (
            {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "2"}},
            [
                (
                    "requests[nvidia.com/gpu]",
                    'Invalid value: "1": must be equal to nvidia.com/gpu limit of 2',
                )
            ],
        ),
        (
            {"requests": {"nvidia.com/gpu": "1"}},
            [("limits", "Required value: Limit must be set for non overcommitable resources")],
        ),
        (
            {"limits": {"nvidia.com/gpu": "0.5"}},
            [
                ("limits[nvidia.com/gpu]", 'Invalid value: "0.5": must be an integer'),
                ("requests[nvidia.com/gpu]", 'Invalid value: "0.5": must be an integer'),
            ],
        ),
    ],
    ids=[
        "valid",
        "negative-request",
        "negative-limit",
        "over-limit",
        "gpu-unequal",
        "gpu-no-limit",
        "gpu-fraction",
    ],
)
def test_the_api_servers_resource_validation(
    resources: dict[str, Any], errors: list[tuple[str, str]]
) -> None:
    spec = {"containers": [{"name": "c", "resources": resources}]}
    default_requests(spec)
    assert resource_errors(spec) == [
        (f"spec.containers[0].resources.{field}", message) for field, message in errors
    ]


def _tainted(name: str, *taints: dict[str, str], unschedulable: bool = False) -> dict[str, Any]:
    node = _node(name, cpu="4")
    node["spec"] = {"taints": list(taints), "unschedulable": unschedulable}
    return node


GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("tolerations", "fits"),
    [
        ([], False),
        ([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}], True),
        ([{"key": "nvidia.com/gpu", "operator": "Equal", "value": "present"}], True),
        ([{"key": "nvidia.com/gpu", "value": "absent"}], False),
        ([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}], False),
        ([{"operator": "Exists"}], True),  # no key: every taint
        ([{"key": "other", "operator": "Exists"}], False),
    ],
)
def test_a_noschedule_taint_needs_a_matching_toleration(
    tolerations: list[dict[str, str]], fits: bool
) -> None:
    pod = _pod(_container({"cpu": "1"}))
    pod["spec"]["tolerations"] = tolerations
    node, message = pick_node(pod, [_tainted("gpu-0", GPU_TAINT)], {})
    assert (node == "gpu-0") is fits
    if not fits:
        assert message == (
            "0/1 nodes are available: 1 node(s) had untolerated taint {nvidia.com/gpu: present}."
        )


def test_taints_are_filtered_before_resources_and_prefer_no_schedule_only_scores() -> None:
    evict = {"key": "spot", "value": "reclaimed", "effect": "NoExecute"}
    soft = {"key": "soft", "value": "", "effect": "PreferNoSchedule"}
    nodes = [_tainted("a", evict), _tainted("b", soft), _node("c", cpu="1")]
    pod = _pod(_container({"cpu": "2"}))
    assert pick_node(pod, nodes, {})[0] == "b"
    big = _pod(_container({"cpu": "8"}))
    assert pick_node(big, nodes, {}) == (
        None,
        "0/3 nodes are available: 2 Insufficient cpu, 1 node(s) had untolerated taint "
        "{spot: reclaimed}.",
    )


def test_a_cordoned_node_takes_a_pod_that_tolerates_unschedulable() -> None:
    cordoned = _tainted("a", unschedulable=True)
    pod = _pod(_container({"cpu": "1"}))
    assert pick_node(pod, [cordoned], {}) == (
        None,
        "0/1 nodes are available: 1 node(s) were unschedulable.",
    )
    pod["spec"]["tolerations"] = [
        {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pick_node(pod, [cordoned], {})[0] == "a"


def test_a_negative_overhead_is_refused() -> None:
    spec = {"containers": [{"name": "c"}], "overhead": {"memory": "-64Mi"}}
    assert resource_errors(spec) == [
        ("spec.overhead[memory]", 'Invalid value: "-64Mi": must be greater than or equal to 0')
    ]
