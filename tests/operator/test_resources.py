"""Builders: command, env, labels, owner references, anti-affinity, resources, schema validity."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest

from finetune_operator.api.constants import (
    CONFIG_FILE_NAME,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    LABEL_ROLE,
    ROLE_RENDEZVOUS,
    ROLE_WORKER,
)
from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.api.spec import DatasetSpec, FineTuneJobSpec
from finetune_operator.resources import (
    Owner,
    build_config_map,
    build_rendezvous_pod,
    build_worker_pod,
    desired_objects,
    merge_node_exclusion,
)
from tests.operator.factories import UID, make_plan

K8S_VERSION = "1.32"


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = pod["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in _container(pod)["env"]}


@pytest.mark.parametrize(
    ("spec_fixture", "nodes", "gpus", "excluded"),
    [
        ("quickstart_spec", 2, 1, []),
        ("gpu8_spec", 2, 8, ["gpu-node-3", "gpu-node-7"]),
    ],
    ids=["quickstart", "8gpu-excluded-nodes"],
)
def test_every_object_is_valid_kubernetes(
    request: pytest.FixtureRequest,
    owner: Owner,
    spec_fixture: str,
    nodes: int,
    gpus: int,
    excluded: list[str],
) -> None:
    spec: FineTuneJobSpec = request.getfixturevalue(spec_fixture)
    objects = desired_objects(owner, spec, make_plan(nodes, gpus), excluded)
    kinds = [o["kind"] for o in objects]
    assert kinds == ["ConfigMap", "Service", "Service", "Pod", *["Pod"] * nodes]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        meta = obj["metadata"]
        assert meta["namespace"] == owner.namespace
        assert meta["labels"][LABEL_JOB] == owner.name
        assert meta["labels"][LABEL_ROLE] in (ROLE_WORKER, ROLE_RENDEZVOUS)
        assert meta["labels"][LABEL_MANAGED_BY] == "finetune-operator"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "finetune.dev/v1alpha1",
                "kind": "FineTuneJob",
                "name": owner.name,
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


def test_object_names(owner: Owner, quickstart_spec: FineTuneJobSpec) -> None:
    names = [o["metadata"]["name"] for o in desired_objects(owner, quickstart_spec, make_plan(2))]
    assert names == [
        "quickstart-config",
        "quickstart",
        "quickstart-rdzv",
        "quickstart-rdzv",
        "quickstart-worker-0",
        "quickstart-worker-1",
    ]


@pytest.mark.parametrize(
    ("min_nodes", "max_nodes", "plan_nodes", "nnodes"),
    [(1, 2, 2, "1:2"), (None, None, 3, "3:3"), (2, None, 2, "2:2"), (None, 4, 4, "4:4")],
    ids=["elastic", "defaults-to-plan", "min-only", "max-only"],
)
def test_worker_command(
    owner: Owner,
    quickstart_spec: FineTuneJobSpec,
    min_nodes: int | None,
    max_nodes: int | None,
    plan_nodes: int,
    nnodes: str,
) -> None:
    spec = quickstart_spec.model_copy(deep=True)
    spec.resources.min_nodes, spec.resources.max_nodes = min_nodes, max_nodes
    pod = build_worker_pod(owner, spec, make_plan(plan_nodes, 1), 0)
    assert _container(pod)["command"] == [
        "python",
        "-m",
        "finetune_trainer.launch",
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=quickstart-rdzv.team-a.svc:29400",
        f"--rdzv-id={UID}",
        # last call: the plan's 1 s step + no checkpoint bytes to save + 5 s of agent slack
        "--rdzv-conf=is_host=false,last_call_timeout=6,keep_alive_interval=2,"
        "keep_alive_max_attempt=3",
        "--max-restarts=3",
        "--local-addr=$(POD_IP)",
        "-m",
        "finetune_trainer",
        "--config",
        "/etc/finetune/job.json",
    ]


def test_worker_env_ports_volumes(owner: Owner, gpu8_spec: FineTuneJobSpec) -> None:
    pod = build_worker_pod(owner, gpu8_spec, make_plan(2, 8), 1)
    env = _env(pod)
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    ports = _container(pod)["ports"]
    assert [(p["name"], p["containerPort"]) for p in ports] == [
        (f"metrics-{i}", 9400 + i) for i in range(8)
    ]
    mounts = {m["mountPath"]: m["name"] for m in _container(pod)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[mounts["/etc/finetune"]]["configMap"] == {"name": "quickstart-config"}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    # The data cache: a pod-lifetime emptyDir, and a trainer budget below its sizeLimit
    # (outgrowing it would get the pod evicted).
    assert volumes[mounts["/var/cache/finetune"]]["emptyDir"] == {"sizeLimit": "32Gi"}
    assert env["FT_DATA_CACHE_DIR"] == "/var/cache/finetune"
    assert 0 < int(env["FT_DATA_CACHE_LIMIT_BYTES"]) < 32 << 30
    assert pod["metadata"]["labels"]["finetune.dev/worker-index"] == "1"


@pytest.mark.parametrize(
    ("limit", "size_limit", "budget"),
    [("32Gi", "32Gi", (32 << 30) - (256 << 20)), (1 << 30, "1073741824", (1 << 30) - (128 << 20)),
     ("500Mi", "500Mi", (500 << 20) - (500 << 17)), ("1.5Ti", "1.5Ti", (3 << 39) - (256 << 20))],
    ids=["default", "integer", "small-limit-small-margin", "fraction"],
)  # fmt: skip
def test_cache_size_limit_reaches_the_pod(
    owner: Owner, gpu8_spec: FineTuneJobSpec, limit: str | int, size_limit: str, budget: int
) -> None:
    """dataset.cacheSizeLimit is the emptyDir's sizeLimit, the ephemeral storage the worker
    requests (so the scheduler finds it a node with that much disk) and, less a margin, the
    trainer's budget."""
    spec = gpu8_spec.model_copy(deep=True)
    if limit != "32Gi":
        spec.dataset = DatasetSpec.model_validate(
            {**spec.dataset.model_dump(by_alias=True), "cacheSizeLimit": limit}
        )
    pod = build_worker_pod(owner, spec, make_plan(2, 8), 0)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["data-cache"]["emptyDir"] == {"sizeLimit": size_limit}
    resources = _container(pod)["resources"]
    assert resources["requests"]["ephemeral-storage"] == size_limit
    assert "ephemeral-storage" not in resources["limits"]
    assert int(_env(pod)["FT_DATA_CACHE_LIMIT_BYTES"]) == budget


def test_worker_security_and_scheduling(owner: Owner, gpu8_spec: FineTuneJobSpec) -> None:
    pod = build_worker_pod(owner, gpu8_spec, make_plan(2, 8), 0)
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] > 0
    assert spec["securityContext"]["runAsNonRoot"] is True
    ctx = _container(pod)["securityContext"]
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["readOnlyRootFilesystem"] is True
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["priorityClassName"] == "training"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["serviceAccountName"] == "trainer"


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        (
            "gpu",
            {
                "requests": {
                    "nvidia.com/gpu": "8",
                    "cpu": "32",
                    "memory": "512Gi",
                    "ephemeral-storage": "32Gi",
                },
                "limits": {"nvidia.com/gpu": "8", "memory": "512Gi"},
            },
        ),
        (
            "cpu",
            {
                "requests": {"cpu": "32", "memory": "512Gi", "ephemeral-storage": "32Gi"},
                "limits": {"memory": "512Gi"},
            },
        ),
    ],
    ids=["gpu", "cpu"],
)
def test_worker_resources(
    owner: Owner, gpu8_spec: FineTuneJobSpec, device: str, expected: dict[str, Any]
) -> None:
    spec = gpu8_spec.model_copy(deep=True)
    spec.resources.device = device  # type: ignore[assignment]
    assert _container(build_worker_pod(owner, spec, make_plan(2, 8), 0))["resources"] == expected


def test_custom_gpu_resource_name(owner: Owner, gpu8_spec: FineTuneJobSpec) -> None:
    spec = gpu8_spec.model_copy(deep=True)
    spec.resources.gpu.resource_name = "amd.com/gpu"
    res = _container(build_worker_pod(owner, spec, make_plan(1, 8), 0))["resources"]
    assert res["limits"]["amd.com/gpu"] == "8"
    assert "nvidia.com/gpu" not in res["limits"]


NOT_IN = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1", "n2"]}


@pytest.mark.parametrize(
    ("user", "excluded", "expected"),
    [
        (None, [], {}),
        (
            None,
            ["n2", "n1", "n2"],
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [NOT_IN]}]
                    }
                }
            },
        ),
        (
            {"podAntiAffinity": {"x": 1}, "nodeAffinity": {"preferredDuringScheduling": []}},
            ["n1", "n2"],
            {
                "podAntiAffinity": {"x": 1},
                "nodeAffinity": {
                    "preferredDuringScheduling": [],
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [NOT_IN]}]
                    },
                },
            },
        ),
        (
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
                            {"matchFields": [{"key": "b", "operator": "Exists"}]},
                        ]
                    }
                }
            },
            ["n1", "n2"],
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "a", "operator": "Exists"}, NOT_IN]},
                            {
                                "matchFields": [{"key": "b", "operator": "Exists"}],
                                "matchExpressions": [NOT_IN],
                            },
                        ]
                    }
                }
            },
        ),
    ],
    ids=["nothing", "excluded-only", "keeps-other-affinity", "anded-into-every-term"],
)
def test_merge_node_exclusion(
    user: dict[str, Any] | None, excluded: list[str], expected: dict[str, Any]
) -> None:
    before = json.dumps(user)
    assert merge_node_exclusion(user, excluded) == expected
    assert json.dumps(user) == before  # the spec's own dict is never mutated


def test_worker_pod_excludes_nodes(owner: Owner, gpu8_spec: FineTuneJobSpec) -> None:
    pod = build_worker_pod(owner, gpu8_spec, make_plan(2, 8), 0, excluded_nodes=["bad"])
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert len(terms) == 2  # the user's two pools, each now also excluding the node
    for term in terms:
        assert {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["bad"]} in term[
            "matchExpressions"
        ]


def test_rendezvous_pod(owner: Owner, gpu8_spec: FineTuneJobSpec) -> None:
    pod = build_rendezvous_pod(owner, gpu8_spec)
    c = _container(pod)
    assert c["command"] == ["python", "-m", "finetune_trainer.rendezvous", "--port", "29400"]
    assert c["readinessProbe"]["tcpSocket"] == {"port": 29400}
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert "nodeSelector" not in pod["spec"] and "affinity" not in pod["spec"]
    assert pod["metadata"]["labels"][LABEL_ROLE] == ROLE_RENDEZVOUS


def test_config_map_round_trips(owner: Owner, quickstart_spec: FineTuneJobSpec) -> None:
    plan = make_plan(2)
    cm = build_config_map(owner, quickstart_spec, plan)
    config = JobConfig.model_validate_json(cm["data"][CONFIG_FILE_NAME])
    assert (config.name, config.namespace, config.uid) == (owner.name, owner.namespace, UID)
    assert config.spec == quickstart_spec and config.plan == plan
    raw = json.loads(cm["data"][CONFIG_FILE_NAME])
    assert "gpusPerNode" in raw["spec"]["resources"] and "worldSize" in raw["plan"]
    assert build_config_map(owner, quickstart_spec, plan) == cm  # byte-stable


def test_config_map_carries_the_deepspeed_config_of_a_deepspeed_plan(
    owner: Owner, quickstart_spec: FineTuneJobSpec
) -> None:
    assert set(build_config_map(owner, quickstart_spec, make_plan(2))["data"]) == {CONFIG_FILE_NAME}
    spec = quickstart_spec.model_copy(update={"strategy": quickstart_spec.strategy.model_copy(
        update={"type": "zero2", "backend": "deepspeed"})})  # fmt: skip
    plan = make_plan(2).model_copy(update={"strategy": "zero2", "backend": "deepspeed"})
    data = build_config_map(owner, spec, plan)["data"]
    config = json.loads(data["deepspeed.json"])
    assert config["zero_optimization"]["stage"] == 2
    assert config["train_batch_size"] == spec.training.global_batch_size


UNREACHABLE, NOT_READY = "node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"


def _lost_node_toleration(key: str, seconds: int) -> dict[str, Any]:
    return {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}


@pytest.mark.parametrize(
    ("own", "added"),
    [
        ([], [NOT_READY, UNREACHABLE]),
        (
            [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            [NOT_READY, UNREACHABLE],
        ),
        ([_lost_node_toleration(UNREACHABLE, 900)], [NOT_READY]),
        # No seconds: the user's pods wait for a lost node for ever (never evicted).
        ([{"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute"}], [NOT_READY]),
        ([{"key": NOT_READY, "operator": "Exists"}], [UNREACHABLE]),  # every effect
        ([{"operator": "Exists"}], []),  # every taint
        (
            [{"key": UNREACHABLE, "operator": "Exists", "effect": "NoSchedule"}],
            [NOT_READY, UNREACHABLE],
        ),
    ],
    ids=[
        "none",
        "gpu-only",
        "own-seconds",
        "own-forever",
        "own-any-effect",
        "wildcard",
        "noschedule",
    ],
)
def test_pods_tolerate_a_lost_node_for_node_lost_seconds_unless_the_user_says(
    owner: Owner,
    quickstart_spec: FineTuneJobSpec,
    own: list[dict[str, Any]],
    added: list[str],
) -> None:
    raw = quickstart_spec.model_dump(by_alias=True, exclude_none=True)
    raw["resources"]["tolerations"] = own
    raw["faultTolerance"]["nodeLostSeconds"] = 45
    spec = FineTuneJobSpec.model_validate(raw)
    expected = [*own, *(_lost_node_toleration(k, 45) for k in added)]
    assert build_worker_pod(owner, spec, make_plan(2), 0)["spec"].get("tolerations", []) == expected
    assert build_rendezvous_pod(owner, spec)["spec"].get("tolerations", []) == expected
    # A Kueue podSet's template has the user's only (worker_template: no part in a flavor).
    template = build_worker_pod(owner, spec, make_plan(2), 0, node_loss=False)
    assert template["spec"].get("tolerations", []) == own


def test_node_lost_seconds_default_and_bounds(quickstart_spec: FineTuneJobSpec) -> None:
    assert quickstart_spec.fault_tolerance.node_lost_seconds == 60
    raw = quickstart_spec.model_dump(by_alias=True, exclude_none=True)
    for bad in (9, 86401, 1.5):
        raw["faultTolerance"]["nodeLostSeconds"] = bad
        with pytest.raises(ValueError, match="nodeLostSeconds"):
            FineTuneJobSpec.model_validate(raw)
