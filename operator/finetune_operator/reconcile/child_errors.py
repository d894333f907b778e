"""What the operator reports when the API server refuses a job's child: an HTTP error in a few
words, and for the children that depend on an optional CRD (PodGroup, Workload) what a user or
admin must do about it. Pure text; `apply.py` and `workload_api.py` do the calls."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from finetune_operator.resources.podgroup import PLURAL as POD_GROUP_PLURAL
from finetune_operator.resources.workload import QUEUE_LABEL, WORKLOAD_PLURAL


def describe_api_error(err: ApiException) -> str:
    return f"HTTP {err.status} {err.reason}"


@dataclass(frozen=True)
class ChildErrorAdvice:
    """What differs between the children whose write can fail for want of a CRD (404) or of
    RBAC (403): the remedies, and who waits (`{resource}` in a remedy: e.g. podgroups.<group>)."""

    kind: str
    plural: str
    not_served: str
    forbidden: str
    waiting: str
    done: str


POD_GROUP_ADVICE = ChildErrorAdvice(
    kind="PodGroup",
    plural=POD_GROUP_PLURAL,
    not_served="install the gang scheduler that defines the CRD {resource}, or unset "
    "spec.resources.gangScheduling",
    forbidden="add its scheduler to the chart value gangScheduling.schedulers",
    waiting="worker pods wait",
    done="created",
)
WORKLOAD_ADVICE = ChildErrorAdvice(
    kind="Workload",
    plural=WORKLOAD_PLURAL,
    not_served=f"install Kueue (v0.15 or later), or remove the job's {QUEUE_LABEL} label",
    forbidden="set the chart value kueue.enabled=true",
    waiting="the job waits",
    done="written",
)


def describe_child_error(obj: dict[str, Any], err: ApiException, advice: ChildErrorAdvice) -> str:
    """What a user or admin must do when a PodGroup or Workload cannot be written (or read):
    the usual causes are a scheduler or Kueue that is not installed (the API server has no
    such resource: 404) and an operator not allowed to manage the resource (403)."""
    group, _, version = obj["apiVersion"].rpartition("/")
    resource = f"{advice.plural}.{group}"
    head = f"{advice.kind} {obj['metadata']['name']} ({describe_api_error(err)})"
    if err.status == 404:
        remedy = advice.not_served.format(resource=resource)
        return (
            f"{head}: the API server does not serve {resource}/{version}: {remedy}; "
            f"{advice.waiting} until it exists"
        )
    if err.status == 403:
        return (
            f"{head}: the operator may not manage {resource}: {advice.forbidden}; "
            f"{advice.waiting} until it may"
        )
    return f"{head}; {advice.waiting} until it is {advice.done}"


def object_absent(err: ApiException, name: str) -> bool:
    """A 404 for the object itself (the API server names it in the Status details), not for
    its resource: an unserved resource's 404 names no object ("the server could not find
    the requested resource")."""
    if err.status != 404:
        return False
    try:
        details = (json.loads(err.body or "{}") or {}).get("details") or {}
    except (ValueError, AttributeError):
        return False
    return isinstance(details, dict) and details.get("name") == name
