"""Services: headless `<job>` for worker DNS, `<job>-rdzv` in front of the rendezvous store."""

from __future__ import annotations

from typing import Any

from finetune_operator.api.constants import (
    METRICS_BASE_PORT,
    RDZV_PORT,
    ROLE_RENDEZVOUS,
    ROLE_WORKER,
    rendezvous_name,
)
from finetune_operator.resources.common import Owner, object_meta, selector_labels

RDZV_PORT_NAME = "rdzv"


def metrics_port_name(local_rank: int) -> str:
    return f"metrics-{local_rank}"


def build_worker_service(owner: Owner, gpus_per_node: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(owner, owner.name, ROLE_WORKER),
        "spec": {
            "clusterIP": "None",
            # Workers have no readiness probe worth waiting for: peers must resolve each other
            # while torchrun is still rendezvousing.
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner, ROLE_WORKER),
            "ports": [
                {
                    "name": metrics_port_name(i),
                    "port": METRICS_BASE_PORT + i,
                    "targetPort": METRICS_BASE_PORT + i,
                    "protocol": "TCP",
                }
                for i in range(gpus_per_node)
            ],
        },
    }


def build_rendezvous_service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(owner, rendezvous_name(owner.name), ROLE_RENDEZVOUS),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner, ROLE_RENDEZVOUS),
            "ports": [
                {
                    "name": RDZV_PORT_NAME,
                    "port": RDZV_PORT,
                    "targetPort": RDZV_PORT,
                    "protocol": "TCP",
                }
            ],
        },
    }
