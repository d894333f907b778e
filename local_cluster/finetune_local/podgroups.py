"""Gang schedulers the local cluster can stand for: their PodGroup CRDs and how a pod names
its group, as scheduler-plugins' Coscheduling and Volcano define them.

The CRDs are our own small structural schemas of the upstream types (scheduler-plugins
``apis/scheduling/v1alpha1``, Volcano ``pkg/apis/scheduling/v1beta1``): the fields the
schedulers read, so the API server prunes and validates a PodGroup as a cluster with the
real CRD installed does. A session without a scheduler has no such resource (404), exactly
as a cluster where it is not installed. Kept apart from the operator's own knowledge
(``finetune_operator.resources.podgroup``) on purpose: the tests check one against the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GangScheduler:
    name: str  # the scheduler's name (pods' spec.schedulerName)
    group: str
    version: str
    pod_label: str | None = None
    pod_annotation: str | None = None
    # Volcano defaults a group's queue; scheduler-plugins has no queue.
    queue_default: str | None = None

    def group_of(self, pod: dict[str, Any]) -> str | None:
        """The name of the PodGroup ``pod`` belongs to, if it names one the way we read."""
        meta = pod.get("metadata", {})
        if self.pod_label:
            return (meta.get("labels") or {}).get(self.pod_label)
        if self.pod_annotation:
            return (meta.get("annotations") or {}).get(self.pod_annotation)
        return None

    def crd(self) -> dict[str, Any]:
        return _crd(self)


GANG_SCHEDULERS: dict[str, GangScheduler] = {
    "coscheduling": GangScheduler(
        "scheduler-plugins-scheduler",
        "scheduling.x-k8s.io",
        "v1alpha1",
        pod_label="scheduling.x-k8s.io/pod-group",
    ),
    "volcano": GangScheduler(
        "volcano",
        "scheduling.volcano.sh",
        "v1beta1",
        pod_annotation="scheduling.k8s.io/group-name",
        queue_default="default",
    ),
}

_QUANTITIES = {
    "type": "object",
    "additionalProperties": {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
    },
}


def _spec_schema(s: GangScheduler) -> dict[str, Any]:
    props: dict[str, Any] = {
        "minMember": {"type": "integer", "format": "int32", "minimum": 0},
        "minResources": _QUANTITIES,
    }
    if s.queue_default is None:
        props["scheduleTimeoutSeconds"] = {"type": "integer", "format": "int32"}
    else:
        props.update(
            {
                "queue": {"type": "string", "default": s.queue_default},
                "priorityClassName": {"type": "string"},
                "minTaskMember": {"type": "object", "additionalProperties": {"type": "integer"}},
            }
        )
    return {"type": "object", "properties": props}


def _crd(s: GangScheduler) -> dict[str, Any]:
    status = {
        "type": "object",
        "properties": {
            "phase": {"type": "string"},
            "running": {"type": "integer"},
            "succeeded": {"type": "integer"},
            "failed": {"type": "integer"},
            "conditions": {
                "type": "array",
                "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
        },
    }
    schema = {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _spec_schema(s),
            "status": status,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"podgroups.{s.group}"},
        "spec": {
            "group": s.group,
            "names": {
                "kind": "PodGroup",
                "listKind": "PodGroupList",
                "plural": "podgroups",
                "singular": "podgroup",
                "shortNames": ["pg"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": s.version,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Status", "type": "string", "jsonPath": ".status.phase"},
                        {"name": "minMember", "type": "integer", "jsonPath": ".spec.minMember"},
                    ],
                }
            ],
        },
    }


def scheduler_for(pod: dict[str, Any], gangs: list[GangScheduler]) -> GangScheduler | None:
    """The gang scheduler installed here that ``pod`` asks for by ``spec.schedulerName``."""
    name = pod.get("spec", {}).get("schedulerName") or "default-scheduler"
    return next((g for g in gangs if g.name == name), None)
