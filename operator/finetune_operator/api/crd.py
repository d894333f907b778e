"""Generate the FineTuneJob CustomResourceDefinition from the pydantic models.

The API server wants a *structural* OpenAPI v3.0 schema (:mod:`.structural_schema` makes one
from pydantic's JSON Schema); cross-field rules that a schema cannot say become CEL
`x-kubernetes-validations` (:mod:`.crd_rules`), so the API server refuses those manifests
before the operator ever sees them.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from finetune_operator.api.constants import (
    API_VERSION,
    CRD_NAME,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
)
from finetune_operator.api.crd_rules import SPEC_CEL_RULES, Schema, immutable_spec_rule
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.api.structural_schema import convert

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "GPUs", "type": "integer", "jsonPath": ".status.worldSize"},
    {"name": "Strategy", "type": "string", "jsonPath": ".status.strategy"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _model_schema(model: type[FineTuneJobSpec] | type[FineTuneJobStatus]) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return convert(raw, defs)


def build_crd() -> dict[str, Any]:
    """The FineTuneJob CRD as a dict (deterministic: the committed YAML is compared to it)."""
    spec_schema = _model_schema(FineTuneJobSpec)
    spec_schema["description"] = (
        "Desired state: what to fine-tune, on what, and how. Immutable once created, except "
        "suspend."
    )
    spec_schema.setdefault("x-kubernetes-validations", []).extend(
        [*copy.deepcopy(SPEC_CEL_RULES), immutable_spec_rule(spec_schema)]
    )
    status_schema = _model_schema(FineTuneJobStatus)
    status_schema["description"] = "Observed state, written by the operator."
    root: Schema = {
        "type": "object",
        "description": "A distributed fine-tuning job for a large language model.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/name": "finetune-operator"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["finetune"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    header = (
        "# Generated from finetune_operator.api by `ftjob crd`; do not edit by hand.\n"
        f"# {API_VERSION} {KIND}\n"
    )
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)
