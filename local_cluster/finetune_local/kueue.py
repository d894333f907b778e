"""Kueue's Workload and ResourceFlavor CRDs, served when a session "has Kueue installed".

Our own small structural schemas of the upstream types (kubernetes-sigs/kueue
``apis/kueue/v1beta2/workload_types.go`` and ``resourceflavor_types.go``): the fields Kueue
and a job controller read and write, with Kueue's bounds and its PodSet CEL rule, and the
Workload's ``status`` a subresource as upstream. The pod template is kept whole (unknown
fields preserved), as the real schema declares every PodSpec field. Kueue itself is not
emulated: no controller admits anything here; a test plays Kueue's part by writing the
Workload's status as Kueue's scheduler would. A session without Kueue has no such resources
(404), exactly as a cluster where it is not installed. Kept apart from the operator's own
knowledge (``finetune_operator.resources.workload``) on purpose.
"""

from __future__ import annotations

from typing import Any

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"

_NAME = {"type": "string", "maxLength": 63, "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
_QUANTITIES = {
    "type": "object",
    "additionalProperties": {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
    },
}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_TOLERATIONS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "key": {"type": "string"},
            "operator": {"type": "string"},
            "value": {"type": "string"},
            "effect": {"type": "string"},
            "tolerationSeconds": {"type": "integer", "format": "int64"},
        },
    },
}
_CONDITIONS = {
    "type": "array",
    "maxItems": 16,
    "items": {
        "type": "object",
        "required": ["type", "status", "reason", "message", "lastTransitionTime"],
        "properties": {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"},
            "message": {"type": "string", "maxLength": 32768},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
        },
    },
}

_POD_SET = {
    "type": "object",
    "required": ["template"],
    "x-kubernetes-validations": [
        {
            "rule": "has(self.minCount) ? self.minCount <= self.count : true",
            "message": "minCount should be positive and less or equal to count",
        }
    ],
    "properties": {
        "name": {**_NAME, "default": "main"},
        "count": {"type": "integer", "format": "int32", "minimum": 0, "default": 1},
        "minCount": {"type": "integer", "format": "int32", "minimum": 1},
        "template": {
            "type": "object",
            "properties": {
                "metadata": {
                    "type": "object",
                    "properties": {"labels": _STRINGS, "annotations": _STRINGS},
                },
                "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
        },
    },
}
_ASSIGNMENT = {
    "type": "object",
    "properties": {
        "name": {**_NAME, "default": "main"},
        "flavors": _STRINGS,
        "resourceUsage": _QUANTITIES,
        "count": {"type": "integer", "format": "int32", "minimum": 0},
    },
}
_WORKLOAD = {
    "type": "object",
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "properties": {
                "podSets": {"type": "array", "minItems": 1, "maxItems": 8, "items": _POD_SET},
                "queueName": {"type": "string", "maxLength": 253},
                "active": {"type": "boolean", "default": True},
                "priority": {"type": "integer", "format": "int32"},
                "priorityClassRef": {
                    "type": "object",
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                    },
                },
                "maximumExecutionTimeSeconds": {"type": "integer", "format": "int32", "minimum": 1},
            },
        },
        "status": {
            "type": "object",
            "properties": {
                "conditions": _CONDITIONS,
                "admission": {
                    "type": "object",
                    "nullable": True,
                    "properties": {
                        "clusterQueue": {"type": "string"},
                        "podSetAssignments": {"type": "array", "maxItems": 8, "items": _ASSIGNMENT},
                    },
                },
                "admissionChecks": {
                    "type": "array",
                    "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                },
                "requeueState": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
        },
    },
}
_FLAVOR = {
    "type": "object",
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "properties": {
                "nodeLabels": _STRINGS,
                "nodeTaints": {
                    "type": "array",
                    "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                },
                "tolerations": _TOLERATIONS,
            },
        },
    },
}


def _crd(kind: str, plural: str, scope: str, schema: dict[str, Any], *, status: bool,
         short: list[str], columns: list[dict[str, str]]) -> dict[str, Any]:  # fmt: skip
    version: dict[str, Any] = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "additionalPrinterColumns": columns,
    }
    if status:
        version["subresources"] = {"status": {}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short,
            },
            "scope": scope,
            "versions": [version],
        },
    }


def kueue_crds() -> list[dict[str, Any]]:
    """The Workload (namespaced, with a status subresource) and ResourceFlavor
    (cluster-scoped) CRDs, with upstream's printer columns."""
    workload = _crd("Workload", "workloads", "Namespaced", _WORKLOAD, status=True, short=["wl"], columns=[
        {"name": "Queue", "type": "string", "jsonPath": ".spec.queueName"},
        {"name": "Reserved in", "type": "string", "jsonPath": ".status.admission.clusterQueue"},
        {"name": "Admitted", "type": "string", "jsonPath": ".status.conditions[?(@.type=='Admitted')].status"},
        {"name": "Finished", "type": "string", "jsonPath": ".status.conditions[?(@.type=='Finished')].status"},
    ])  # fmt: skip
    flavor = _crd("ResourceFlavor", "resourceflavors", "Cluster", _FLAVOR, status=False,
                  short=["flavor", "flavors", "rf"], columns=[])  # fmt: skip
    return [workload, flavor]
