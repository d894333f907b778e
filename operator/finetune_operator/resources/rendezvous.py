"""The rendezvous pod `<job>-rdzv`: a standalone TCPStore that outlives any worker."""

from __future__ import annotations

from typing import Any

from finetune_operator.api.constants import (
    DEFAULT_TRAINER_IMAGE,
    RDZV_PORT,
    ROLE_RENDEZVOUS,
    rendezvous_name,
)
from finetune_operator.api.spec import FineTuneJobSpec
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
from finetune_operator.resources.services import RDZV_PORT_NAME

RDZV_CONTAINER = "rendezvous"
RDZV_GRACE_SECONDS = 30
# The store holds a few keys per rendezvous round: small, CPU-only, no accelerator.
RDZV_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "100m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}


def rendezvous_command() -> list[str]:
    return ["python", "-m", "finetune_trainer.rendezvous", "--port", str(RDZV_PORT)]


def build_rendezvous_pod(
    owner: Owner, spec: FineTuneJobSpec, *, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    tmp, tmp_mount = tmp_volume()
    pod_spec: dict[str, Any] = {
        # Never: a crashed store is a job-level restart the operator counts and backs off.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": RDZV_GRACE_SECONDS,
        "securityContext": pod_security_context(),
        "containers": [
            {
                "name": RDZV_CONTAINER,
                "image": spec.image or DEFAULT_TRAINER_IMAGE,
                "command": rendezvous_command(),
                "env": [{"name": "HOME", "value": "/tmp"}, *downward_env()],
                "ports": [{"name": RDZV_PORT_NAME, "containerPort": RDZV_PORT, "protocol": "TCP"}],
                "readinessProbe": {
                    "tcpSocket": {"port": RDZV_PORT},
                    "periodSeconds": 2,
                    "failureThreshold": 3,
                },
                "resources": RDZV_RESOURCES,
                # A crashed store says why (its traceback's last line) in the job's Restarting
                # condition, as a worker does (reconcile/crash.py).
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "securityContext": container_security_context(),
                "volumeMounts": [tmp_mount],
            }
        ],
        "volumes": [tmp],
    }
    # Tolerations only allow, never require, so GPU-only clusters can still host the store;
    # the workers' nodeSelector/affinity would needlessly pin it onto a GPU node. A store on a
    # lost node is evicted as soon as the workers are: they cannot re-form without it.
    pod_spec["tolerations"] = pod_tolerations(spec)
    set_common_pod_fields(pod_spec, spec)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": object_meta(
            owner, rendezvous_name(owner.name), ROLE_RENDEZVOUS, annotations=annotations
        ),
        "spec": pod_spec,
    }
