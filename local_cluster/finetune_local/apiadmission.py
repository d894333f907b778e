"""What the API server checks and fills in on an object before it stores it.

Decisions only, no store: metadata types and names, server-owned fields, the defaults the
built-in kinds get (Pod, Service, Namespace; a pod's requests, limits and QoS class are
:mod:`.podresources`), CRD schemas of custom resources, the status a
new CRD is given, and what ``generation`` tracks. :mod:`.apiobjects` applies them on create
and update.
"""

from __future__ import annotations

import datetime
import random
import re
from collections.abc import Callable
from typing import Any

from finetune_local.apiresources import ResourceType
from finetune_local.apistore import bad_request, invalid
from finetune_local.podresources import default_requests, qos_class, validate_resources
from finetune_local.taints import TAINT_NOT_READY, TAINT_UNREACHABLE

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # what the apiserver's generateName uses
SERVER_OWNED = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
)
Clock = Callable[[], datetime.datetime]


def spec_part(obj: dict[str, Any], rtype: ResourceType) -> dict[str, Any]:
    """What ``generation`` tracks: all but metadata (and status, where it is a subresource)."""
    skip = ("metadata", "status") if rtype.status_subresource else ("metadata",)
    return {k: v for k, v in obj.items() if k not in skip}


def check_object_meta(obj: dict[str, Any]) -> None:
    """A real server decodes metadata into the typed ObjectMeta: a wrong type is a 400, not
    something to store (or to crash on)."""
    meta = obj.get("metadata", {})
    if not isinstance(meta, dict):
        raise bad_request(
            "Object 'metadata' must be an object: cannot unmarshal "
            f"{type(meta).__name__} into Go struct field .metadata of type v1.ObjectMeta"
        )
    for key in ("name", "namespace", "generateName", "resourceVersion", "uid"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise bad_request(
                f"metadata.{key}: cannot unmarshal {type(meta[key]).__name__} into a string"
            )
    for key in ("labels", "annotations"):
        value = meta.get(key)
        if value is not None and not (
            isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
        ):
            raise bad_request(f"metadata.{key}: must be a map of strings")


def generated_name(prefix: str) -> str:
    return prefix + "".join(random.choices(_SUFFIX_CHARS, k=5))


def validate_name(rtype: ResourceType, name: Any) -> None:
    if not name:
        raise invalid(
            rtype, "", [("metadata.name", "Required value: name or generateName is required")]
        )
    rule = _LABEL if rtype.kind in ("Service", "Namespace") else _NAME
    if (
        not isinstance(name, str)
        or len(name) > (63 if rule is _LABEL else 253)
        or not rule.fullmatch(name)
    ):
        raise invalid(
            rtype,
            str(name),
            [
                (
                    "metadata.name",
                    f'Invalid value: "{name}": a lowercase '
                    "RFC 1123 name must consist of lower case alphanumeric "
                    "characters, '-' or '.'",
                )
            ],
        )


# The DefaultTolerationSeconds admission plugin's tolerations (kube-apiserver's
# --default-not-ready-toleration-seconds and --default-unreachable-toleration-seconds, 300).
DEFAULT_TOLERATION_SECONDS = 300


def add_default_toleration_seconds(spec: dict[str, Any]) -> None:
    """DefaultTolerationSeconds, on pod create: a pod that does not tolerate the not-ready or
    unreachable NoExecute taint gets a toleration of it for 300 s, so that the taint eviction
    controller evicts it from a lost node 5 minutes after the node was tainted. Kubernetes'
    own test of "tolerates" here is the key (or none) and the effect (NoExecute or none),
    whatever the operator, value or seconds: a pod's own toleration of the key always wins."""
    tolerations = spec.get("tolerations") or []
    for key in (TAINT_NOT_READY, TAINT_UNREACHABLE):
        if any(
            isinstance(t, dict)
            and (t.get("key") or "") in ("", key)
            and (t.get("effect") or "") in ("", "NoExecute")
            for t in tolerations
        ):
            continue
        tolerations.append(
            {
                "key": key,
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": DEFAULT_TOLERATION_SECONDS,
            }
        )
    spec["tolerations"] = tolerations


def apply_builtin_defaults(rtype: ResourceType, obj: dict[str, Any], serial: int) -> None:
    """Defaults of the built-in kinds (and, for a pod, the admission plugins' additions);
    ``serial`` (the next resourceVersion) picks a Service's cluster IP."""
    if rtype.group:
        return
    if rtype.kind == "Pod":
        spec = obj.setdefault("spec", {})
        add_default_toleration_seconds(spec)
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("schedulerName", "default-scheduler")
        default_requests(spec)
        validate_resources(rtype, obj["metadata"].get("name", ""), spec)
        obj["status"] = {"phase": "Pending", "qosClass": qos_class(spec)}
    elif rtype.kind == "Service":
        spec = obj.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        if spec.get("clusterIP") != "None":
            spec["clusterIP"] = f"10.96.{serial // 250 % 250}.{serial % 250 + 1}"
        for port in spec.get("ports", []):
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
    elif rtype.kind == "Namespace":
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"][
            "name"
        ]
        obj["status"] = {"phase": "Active"}


def validate_custom(
    rtype: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None
) -> dict[str, Any]:
    """A custom resource normalised (defaults, pruning) and checked against its CRD's schema."""
    if rtype.schema is None:
        return obj
    normalised = rtype.schema.normalise(obj)
    errors = rtype.schema.validate(normalised, old)
    if errors:
        raise invalid(rtype, obj["metadata"].get("name", ""), errors)
    return normalised


def check_no_new_finalizers(
    rtype: ResourceType, current: dict[str, Any], meta: dict[str, Any]
) -> None:
    """An object being deleted may lose finalizers, never gain one."""
    if not current["metadata"].get("deletionTimestamp"):
        return
    added = set(meta.get("finalizers") or []) - set(current["metadata"].get("finalizers") or [])
    if added:
        raise invalid(
            rtype,
            current["metadata"]["name"],
            [
                (
                    "metadata.finalizers",
                    "Forbidden: no new finalizers can be added if the object is being deleted",
                )
            ],
        )


def established_crd_status(crd: dict[str, Any], now: str) -> dict[str, Any]:
    """The status of a CRD the server has accepted: its names taken, established at once."""
    return {
        "acceptedNames": crd["spec"]["names"],
        "storedVersions": [v["name"] for v in crd["spec"]["versions"] if v.get("storage")],
        "conditions": [
            {"type": t, "status": "True", "reason": r, "message": "", "lastTransitionTime": now}
            for t, r in (
                ("NamesAccepted", "NoConflicts"),
                ("Established", "InitialNamesAccepted"),
            )
        ],
    }
