"""Worker pods `<job>-worker-<i>`: one elastic torchrun agent per pod."""

from __future__ import annotations

from typing import Any

from finetune_operator.api.constants import (
    CONFIG_MOUNT_DIR,
    CONFIG_PATH,
    DATA_CACHE_MOUNT_DIR,
    DEFAULT_TRAINER_IMAGE,
    LABEL_WORKER_INDEX,
    METRICS_BASE_PORT,
    RDZV_PORT,
    ROLE_WORKER,
    config_map_name,
    rendezvous_name,
    worker_name,
)
from finetune_operator.api.elastic_timeouts import rendezvous_last_call_seconds
from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.storage import SECRET_KEYS_OPTIONAL, SECRET_KEYS_REQUIRED
from finetune_operator.resources.affinity import merge_node_exclusion
from finetune_operator.resources.common import (
    Owner,
    container_security_context,
    downward_env,
    object_meta,
    pod_security_context,
    pod_tolerations,
    set_common_pod_fields,
    tmp_volume,
)
from finetune_operator.resources.podgroup import join_gang
from finetune_operator.resources.services import metrics_port_name

WORKER_CONTAINER = "trainer"
# Long enough for the trainer to finish its step and a final checkpoint save after SIGTERM.
WORKER_GRACE_SECONDS = 120
CONFIG_VOLUME = "config"
SHM_VOLUME = "dshm"
# The tokenized blocks, built by one local rank and mapped by all (finetune_trainer.data.cache).
# An emptyDir on the node's disk: torchelastic's restarts inside the container reuse it; a
# replacement pod copies it from the job's checkpoint volume or rebuilds it once. Its size is
# `dataset.cacheSizeLimit`. A pod whose emptyDir outgrows its sizeLimit is evicted, so the
# trainer is told a budget below it and tokenizes in memory instead of overrunning.
DATA_CACHE_VOLUME = "data-cache"
DATA_CACHE_MARGIN_BYTES = 256 << 20  # lock files, meta and a copy in flight's rounding


def data_cache_budget_bytes(spec: FineTuneJobSpec) -> int:
    """What the trainer may put in the cache: the sizeLimit less a margin (an eighth of small
    limits: the kubelet measures the volume only every few seconds)."""
    limit = spec.dataset.cache_size_limit_bytes
    return limit - min(DATA_CACHE_MARGIN_BYTES, limit // 8)


TORCHRUN_LAUNCHER: tuple[str, ...] = ("python", "-m", "finetune_trainer.launch")
# The single place for extra torchrun flags the trainer needs (e.g. "--local-addr=$(POD_IP)";
# Kubernetes expands $(VAR) in a command from the container's env).
TORCHRUN_EXTRA_FLAGS: tuple[str, ...] = (
    # Publish the pod's own address to the other agents, not socket.getfqdn().
    "--local-addr=$(POD_IP)",
)

WORKER_ENV: dict[str, str] = {
    # torch 2.13 elastic: without it a scale-up after a scale-down hangs (TOOLING.md).
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    # The root filesystem is read-only: library caches go to the /tmp emptyDir.
    "HOME": "/tmp",
    "FT_DATA_CACHE_DIR": DATA_CACHE_MOUNT_DIR,
}


def rendezvous_endpoint(owner: Owner) -> str:
    return f"{rendezvous_name(owner.name)}.{owner.namespace}.svc:{RDZV_PORT}"


def node_range(spec: FineTuneJobSpec, plan: Plan) -> tuple[int, int]:
    """Elastic bounds: the user's minNodes/maxNodes, each defaulting to the planned nodes."""
    res = spec.resources
    low = res.min_nodes if res.min_nodes is not None else plan.nodes
    high = res.max_nodes if res.max_nodes is not None else max(plan.nodes, low)
    return low, high


def rendezvous_conf(spec: FineTuneJobSpec, plan: Plan) -> str:
    """torchrun's c10d rendezvous options. The store lives in the rendezvous pod, so no agent
    may try to host it. A lost node expires after 3 missed 2 s keep-alives; the last call
    lets surviving agents, whose workers stop (a step and a final save) before they rejoin,
    into the same round (api/elastic_timeouts.py): one re-form, not two."""
    last_call = rendezvous_last_call_seconds(spec, plan)
    return (
        f"is_host=false,last_call_timeout={last_call},keep_alive_interval=2,"
        "keep_alive_max_attempt=3"
    )


def worker_command(
    owner: Owner, spec: FineTuneJobSpec, plan: Plan, max_restarts: int | None = None
) -> list[str]:
    """`max_restarts`: torchrun's own budget of failure restarts in this pod, the job's budget
    left when the pod is made (reconcile/budget.py); None: all of `maxRestarts` (the pod
    template of a Kueue Workload, which must not change as restarts are spent)."""
    low, high = node_range(spec, plan)
    restarts = spec.fault_tolerance.max_restarts if max_restarts is None else max_restarts
    return [
        # torchrun through a thin launcher: a graceful stop (SIGTERM) exits 143 with one log
        # line instead of torchrun's SignalException traceback (finetune_trainer/launch.py).
        *TORCHRUN_LAUNCHER,
        f"--nnodes={low}:{high}",
        f"--nproc-per-node={plan.gpus_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous_endpoint(owner)}",
        f"--rdzv-id={owner.uid}",
        f"--rdzv-conf={rendezvous_conf(spec, plan)}",
        f"--max-restarts={restarts}",
        *TORCHRUN_EXTRA_FLAGS,
        "-m",
        "finetune_trainer",
        "--config",
        CONFIG_PATH,
    ]


def object_store_env(spec: FineTuneJobSpec) -> list[dict[str, Any]]:
    """The object store's credentials as env from the job's Secret (`secretKeyRef`): the
    kubelet resolves them, so neither the spec, the ConfigMap nor the operator ever holds
    them, and a missing Secret or key keeps the worker from starting
    (CreateContainerConfigError) rather than failing it later."""
    store = spec.storage.object_store
    if store is None or not store.secret_name:
        return []
    keys = [(k, False) for k in SECRET_KEYS_REQUIRED] + [(k, True) for k in SECRET_KEYS_OPTIONAL]
    env: list[dict[str, Any]] = []
    for key, optional in keys:
        ref: dict[str, Any] = {"name": store.secret_name, "key": key}
        if optional:
            ref["optional"] = True
        env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def worker_resources(spec: FineTuneJobSpec, plan: Plan) -> dict[str, dict[str, str]]:
    """The worker container's requests and limits (`pod_resources` for the plan's GPUs)."""
    return pod_resources(spec, plan.gpus_per_node)


def pod_resources(spec: FineTuneJobSpec, gpus_per_node: int) -> dict[str, dict[str, str]]:
    """A worker container's requests and limits with `gpus_per_node` accelerators (unused
    on cpu): what the scheduler places it by. `ftjob run --local` refuses early from it."""
    res = spec.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if res.device != "cpu":
        # Extended resources must have requests == limits.
        requests[res.gpu.resource_name] = limits[res.gpu.resource_name] = str(gpus_per_node)
    if res.cpu:
        # A request without a limit: CFS throttling would slow data loading and NCCL progress
        # threads and manufacture exactly the stragglers we try to detect.
        requests["cpu"] = res.cpu
    if res.memory:
        requests["memory"] = limits["memory"] = res.memory
    # The data-cache emptyDir may fill up to its sizeLimit: request it, so the scheduler puts
    # the pod only on a node with that much ephemeral storage left, and so the kubelet, which
    # evicts first the pods using more than they requested when the node's disk runs short,
    # never picks a worker for its cache (an eviction re-forms the whole job). No limit: the
    # volume's sizeLimit bounds the cache, and a container limit would also count logs.
    requests["ephemeral-storage"] = spec.dataset.cache_size_limit
    out: dict[str, dict[str, str]] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _container(
    owner: Owner, spec: FineTuneJobSpec, plan: Plan, max_restarts: int | None
) -> dict[str, Any]:
    _, tmp_mount = tmp_volume()
    container: dict[str, Any] = {
        "name": WORKER_CONTAINER,
        "image": spec.image or DEFAULT_TRAINER_IMAGE,
        "command": worker_command(owner, spec, plan, max_restarts),
        "env": [{"name": k, "value": v} for k, v in WORKER_ENV.items()]
        + [{"name": "FT_DATA_CACHE_LIMIT_BYTES", "value": str(data_cache_budget_bytes(spec))}]
        + downward_env()
        + object_store_env(spec),
        "ports": [
            {
                "name": metrics_port_name(i),
                "containerPort": METRICS_BASE_PORT + i,
                "protocol": "TCP",
            }
            for i in range(plan.gpus_per_node)
        ],
        "securityContext": container_security_context(),
        # The trainer writes its final step/loss/checkpoint to /dev/termination-log, which the
        # operator reads once the pod has exited (metrics are gone by then); on a crash with
        # no message the log's tail shows in `kubectl describe pod` instead.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT_DIR, "readOnly": True},
            {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
            tmp_mount,
            {"name": DATA_CACHE_VOLUME, "mountPath": DATA_CACHE_MOUNT_DIR},
            # The job's storage (api/storage.py): where checkpoints, output, data and weights
            # live, since the root filesystem is read-only.
            *(mount for _, mount in spec.storage.mounts()),
        ],
    }
    resources = worker_resources(spec, plan)
    if resources:
        container["resources"] = resources
    return container


def _volumes(owner: Owner, spec: FineTuneJobSpec) -> list[dict[str, Any]]:
    tmp, _ = tmp_volume()
    return [
        {"name": CONFIG_VOLUME, "configMap": {"name": config_map_name(owner.name)}},
        # NCCL and the dataloader share memory through /dev/shm; the runtime default is 64 MiB.
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}},
        tmp,
        {"name": DATA_CACHE_VOLUME, "emptyDir": {"sizeLimit": spec.dataset.cache_size_limit}},
    ]


def build_worker_pod(
    owner: Owner,
    spec: FineTuneJobSpec,
    plan: Plan,
    index: int,
    *,
    excluded_nodes: list[str] | None = None,
    annotations: dict[str, str] | None = None,
    max_restarts: int | None = None,
    node_loss: bool = True,
) -> dict[str, Any]:
    """Worker pod `index`. `node_loss`: with the tolerations of a lost node for
    `nodeLostSeconds` (common.pod_tolerations); False for a Kueue podSet's template."""
    res = spec.resources
    name = worker_name(owner.name, index)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": WORKER_GRACE_SECONDS,
        # hostname + subdomain give each worker a stable DNS name in the headless Service.
        "hostname": name,
        "subdomain": owner.name,
        "securityContext": pod_security_context(),
        "containers": [_container(owner, spec, plan, max_restarts)],
        "volumes": _volumes(owner, spec) + spec.storage.pod_volumes(),
    }
    affinity = merge_node_exclusion(res.affinity, excluded_nodes or [])
    if affinity:
        pod_spec["affinity"] = affinity
    if res.node_selector:
        pod_spec["nodeSelector"] = dict(res.node_selector)
    tolerations = pod_tolerations(spec, node_loss=node_loss)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    set_common_pod_fields(pod_spec, spec)
    meta = object_meta(
        owner,
        name,
        ROLE_WORKER,
        extra_labels={LABEL_WORKER_INDEX: str(index)},
        annotations=annotations,
    )
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
    return join_gang(pod, owner, spec)
