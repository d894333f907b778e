"""Metadata, ownership and pod-hardening pieces shared by every builder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune_operator.api.constants import (
    API_VERSION,
    KIND,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    LABEL_ROLE,
    MANAGED_BY,
    TAINT_NODE_NOT_READY,
    TAINT_NODE_UNREACHABLE,
)
from finetune_operator.api.spec import FineTuneJobSpec

# A fixed non-root identity: the trainer image's USER may be a name, and the kubelet can only
# enforce runAsNonRoot on a numeric uid, so we pin one rather than trust the image.
RUN_AS_USER = 1000
TMP_VOLUME = "tmp"
TMP_MOUNT = "/tmp"


@dataclass(frozen=True)
class Owner:
    """The FineTuneJob that owns the objects being built."""

    name: str
    namespace: str
    uid: str


def job_labels(owner: Owner, role: str) -> dict[str, str]:
    return {LABEL_JOB: owner.name, LABEL_ROLE: role, LABEL_MANAGED_BY: MANAGED_BY}


def selector_labels(owner: Owner, role: str) -> dict[str, str]:
    """Only the stable identity labels: a Service selector must not depend on managed-by."""
    return {LABEL_JOB: owner.name, LABEL_ROLE: role}


def owner_reference(owner: Owner) -> dict[str, Any]:
    # controller + blockOwnerDeletion: foreground deletion of the job waits for its children,
    # and no other controller can adopt them (the same reference kopf.adopt writes).
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(
    owner: Owner,
    name: str,
    role: str,
    *,
    extra_labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner.namespace,
        "labels": {**job_labels(owner, role), **(extra_labels or {})},
        "ownerReferences": [owner_reference(owner)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        # Volumes (checkpoint dirs, /tmp) become writable by the pinned group.
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    # The trainer writes only to /tmp, /dev/shm and its checkpoint/output locations, so the
    # root filesystem can stay read-only (HOME points at /tmp for library caches).
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def downward_env() -> list[dict[str, Any]]:
    """POD_NAME, POD_IP, NODE_NAME, POD_NAMESPACE from the downward API."""
    fields = {
        "POD_NAME": "metadata.name",
        "POD_NAMESPACE": "metadata.namespace",
        "POD_IP": "status.podIP",
        "NODE_NAME": "spec.nodeName",
    }
    return [
        {"name": env, "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for env, path in fields.items()
    ]


def tmp_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    """An emptyDir for /tmp: needed because the root filesystem is read-only."""
    return {"name": TMP_VOLUME, "emptyDir": {}}, {"name": TMP_VOLUME, "mountPath": TMP_MOUNT}


def tolerates_node_loss(toleration: dict[str, Any], key: str) -> bool:
    """Whether a toleration covers the NoExecute taint `key`, by Kubernetes' own test in its
    DefaultTolerationSeconds admission: the key (or none) and the effect (NoExecute or none),
    whatever its operator, value or seconds."""
    return toleration.get("key") in (None, "", key) and toleration.get("effect") in (
        None,
        "",
        "NoExecute",
    )


def pod_tolerations(spec: FineTuneJobSpec, *, node_loss: bool = True) -> list[dict[str, Any]]:
    """The job's tolerations, plus (`node_loss`) the unreachable and not-ready NoExecute taints
    for `faultTolerance.nodeLostSeconds`: without them the API server gives every pod 300 s,
    and a job waits 5 minutes for a lost node's pods to be evicted. A toleration of the user's
    for either taint wins (Kubernetes adds its own only where the pod has none either)."""
    out = [dict(t) for t in spec.resources.tolerations]
    if not node_loss:
        return out
    for key in (TAINT_NODE_NOT_READY, TAINT_NODE_UNREACHABLE):
        if not any(tolerates_node_loss(t, key) for t in out):
            out.append(
                {
                    "key": key,
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": spec.fault_tolerance.node_lost_seconds,
                }
            )
    return out


def pull_secrets(names: list[str]) -> list[dict[str, str]]:
    return [{"name": n} for n in names]


def set_common_pod_fields(pod_spec: dict[str, Any], spec: FineTuneJobSpec) -> None:
    """Fields every pod of the job shares: priority, pull secrets, service account, token."""
    res = spec.resources
    # Trainers and the store never call the Kubernetes API: no token unless the job asks.
    pod_spec["automountServiceAccountToken"] = res.automount_service_account_token
    if res.priority_class_name:
        pod_spec["priorityClassName"] = res.priority_class_name
    if res.image_pull_secrets:
        pod_spec["imagePullSecrets"] = pull_secrets([s.name for s in res.image_pull_secrets])
    if res.service_account_name:
        pod_spec["serviceAccountName"] = res.service_account_name
