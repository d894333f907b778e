"""Pure builders of the Kubernetes objects of a FineTuneJob (DESIGN.md §5): plain dicts, no I/O."""

from __future__ import annotations

from typing import Any

from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.resources.affinity import merge_node_exclusion
from finetune_operator.resources.common import Owner, owner_reference
from finetune_operator.resources.configmap import build_config_map, render_job_config
from finetune_operator.resources.network import build_network_policy, network_policy_name
from finetune_operator.resources.podgroup import build_pod_group, gang_of, pod_group_name
from finetune_operator.resources.rendezvous import build_rendezvous_pod
from finetune_operator.resources.services import build_rendezvous_service, build_worker_service
from finetune_operator.resources.worker import (
    TORCHRUN_EXTRA_FLAGS,
    build_worker_pod,
    node_range,
    rendezvous_endpoint,
    worker_command,
    worker_resources,
)


def build_job_pod_group(owner: Owner, spec: FineTuneJobSpec, plan: Plan) -> dict[str, Any] | None:
    """The job's PodGroup (gang scheduling; None when off): minMember the elastic minimum of
    worker pods, minResources what that many request."""
    requests = worker_resources(spec, plan).get("requests", {})
    return build_pod_group(owner, spec, node_range(spec, plan)[0], requests)


def build_shared_objects(
    owner: Owner,
    spec: FineTuneJobSpec,
    plan: Plan,
    *,
    network_policy: tuple[str, ...] | None = None,
) -> list[dict[str, Any]]:
    """The objects that live as long as the job (kept while suspended): ConfigMap, Services,
    and the NetworkPolicy when `network_policy` names the namespaces that scrape metrics."""
    shared = [
        build_config_map(owner, spec, plan),
        build_worker_service(owner, plan.gpus_per_node),
        build_rendezvous_service(owner),
    ]
    if network_policy is not None:
        shared.append(build_network_policy(owner, plan.gpus_per_node, list(network_policy)))
    return shared


def desired_objects(
    owner: Owner, spec: FineTuneJobSpec, plan: Plan, excluded_nodes: list[str] | None = None
) -> list[dict[str, Any]]:
    """Every object of a running job, in creation order (the PodGroup before its pods)."""
    pod_group = build_job_pod_group(owner, spec, plan)
    return [
        *build_shared_objects(owner, spec, plan),
        *([pod_group] if pod_group is not None else []),
        build_rendezvous_pod(owner, spec),
        *(
            build_worker_pod(owner, spec, plan, i, excluded_nodes=excluded_nodes)
            for i in range(plan.nodes)
        ),
    ]


__all__ = [
    "TORCHRUN_EXTRA_FLAGS",
    "Owner",
    "build_config_map",
    "build_job_pod_group",
    "build_network_policy",
    "build_rendezvous_pod",
    "build_rendezvous_service",
    "build_shared_objects",
    "build_worker_pod",
    "build_worker_service",
    "desired_objects",
    "gang_of",
    "merge_node_exclusion",
    "network_policy_name",
    "node_range",
    "owner_reference",
    "pod_group_name",
    "render_job_config",
    "rendezvous_endpoint",
    "worker_command",
]
