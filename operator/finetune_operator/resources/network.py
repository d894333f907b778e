"""The job's NetworkPolicy `<job>-network` (issue 11.7), built when the operator's policy asks.

The rendezvous store (TCPStore, port 29400) has no authentication, and NCCL/gloo listen on
ports they pick at run time: anyone who can reach a job's pods can join its rendezvous or read
its tensors. A policy per job (rather than one in the chart) can name exactly the job's own
pods, in whatever namespace the job runs:

- every port, from the job's own pods (rendezvous, collectives, worker DNS peers);
- the trainer metrics ports (9400 + local rank), from the operator's namespace and the
  configured monitoring namespaces (Prometheus);
- nothing else: the policy selects every pod of the job, so all other ingress is denied.

Egress stays open (data, checkpoints and object stores are wherever the job points). Enforced
only where the cluster's network plugin implements NetworkPolicy; elsewhere it is inert.
"""

from __future__ import annotations

from typing import Any

from finetune_operator.api.constants import LABEL_JOB, METRICS_BASE_PORT, ROLE_WORKER
from finetune_operator.resources.common import Owner, object_meta

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace


def network_policy_name(job: str) -> str:
    return f"{job}-network"


def build_network_policy(
    owner: Owner, gpus_per_node: int, metrics_namespaces: list[str]
) -> dict[str, Any]:
    own_pods = {"podSelector": {"matchLabels": {LABEL_JOB: owner.name}}}
    ingress: list[dict[str, Any]] = [{"from": [own_pods]}]
    if metrics_namespaces:
        ports = [
            {"protocol": "TCP", "port": METRICS_BASE_PORT + rank} for rank in range(gpus_per_node)
        ]
        scrapers = [
            {
                "namespaceSelector": {
                    "matchExpressions": [
                        {
                            "key": NAMESPACE_NAME_LABEL,
                            "operator": "In",
                            "values": sorted(set(metrics_namespaces)),
                        }
                    ]
                }
            }
        ]
        ingress.append({"from": scrapers, "ports": ports})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(owner, network_policy_name(owner.name), ROLE_WORKER),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: owner.name}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
