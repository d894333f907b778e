"""Generate the FineTuneJob CustomResourceDefinition from the pydantic models.

Pydantic emits JSON Schema 2020-12; the API server wants a *structural* OpenAPI v3.0 schema:
no $refs, no anyOf of different types (except int-or-string), boolean exclusive bounds,
explicit types everywhere. Cross-field rules that a schema cannot say become CEL
`x-kubernetes-validations`, so the API server refuses those manifests before the operator
ever sees them.
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
from finetune_operator.api.limits import MAX_MICRO_BATCH, MAX_SHORT_STRING
from finetune_operator.api.quantity import BYTES_PATTERN
from finetune_operator.api.spec import NO_PARENT_SEGMENTS_RULE, FineTuneJobSpec
from finetune_operator.api.status import FineTuneJobStatus

Schema = dict[str, Any]

# CEL rules per model (keyed by the pydantic class name, i.e. the $defs key). Each mirrors a
# pydantic validator in spec.py, so the operator and the API server refuse the same manifests.
CEL_RULES: dict[str, list[dict[str, str]]] = {
    "ResourcesSpec": [
        {
            "rule": "!has(self.minNodes) || !has(self.maxNodes) || self.minNodes <= self.maxNodes",
            "message": "minNodes must be <= maxNodes",
            "fieldPath": ".minNodes",
            "reason": "FieldValueInvalid",
        },
    ],
    "GangSchedulingSpec": [
        {
            "rule": "!has(self.scheduleTimeoutSeconds) || self.scheduler == 'coscheduling'",
            "message": "scheduleTimeoutSeconds applies to scheduler coscheduling only",
            "fieldPath": ".scheduleTimeoutSeconds",
        },
        {
            "rule": "!has(self.queue) || self.scheduler == 'volcano'",
            "message": "queue applies to scheduler volcano only",
            "fieldPath": ".queue",
        },
        {
            "rule": "!has(self.schedulerName) || self.scheduler != 'none'",
            "message": "schedulerName needs a scheduler, not none",
            "fieldPath": ".schedulerName",
        },
    ],
    "TrainingSpec": [
        {"rule": "has(self.maxSteps) || has(self.epochs)", "message": "set maxSteps or epochs"},
        {
            "rule": "!has(self.maxSteps) || self.warmupSteps <= self.maxSteps",
            "message": "warmupSteps must not exceed maxSteps",
            "fieldPath": ".warmupSteps",
        },
    ],
    "MethodSpec": [
        {
            "rule": "self.type != 'full' || !has(self.lora)",
            "message": "lora is set but type is 'full'",
            "fieldPath": ".lora",
        },
    ],
    "StrategySpec": [
        {
            "rule": "!(self.type in ['zero1', 'zero2']) || self.backend != 'fsdp'",
            "message": "zero1 and zero2 need backend deepspeed",
            "fieldPath": ".backend",
        },
        {
            "rule": "!self.type.startsWith('fsdp') || self.backend != 'deepspeed'",
            "message": "fsdp strategies need backend fsdp",
            "fieldPath": ".backend",
        },
        {
            "rule": "!has(self.deepspeedConfig) || self.backend == 'deepspeed' || "
            "self.type in ['zero1', 'zero2']",
            "message": "deepspeedConfig needs backend deepspeed",
            "fieldPath": ".deepspeedConfig",
        },
    ],
    "FaultToleranceSpec": [
        {
            "rule": "!has(self.collectiveTimeoutSeconds) || "
            "self.collectiveTimeoutSeconds < self.hangTimeoutSeconds",
            "message": "collectiveTimeoutSeconds must be below hangTimeoutSeconds",
            "fieldPath": ".collectiveTimeoutSeconds",
        },
        {
            "rule": "!has(self.collectiveTimeoutSeconds) || "
            "!has(self.startupCollectiveTimeoutSeconds) || "
            "self.startupCollectiveTimeoutSeconds >= self.collectiveTimeoutSeconds",
            "message": "startupCollectiveTimeoutSeconds must be >= collectiveTimeoutSeconds",
            "fieldPath": ".startupCollectiveTimeoutSeconds",
        },
    ],
    "DatasetSpec": [
        {
            # The form only (the operator also refuses one below the minimum, naming it).
            "rule": "!has(self.cacheSizeLimit) || (type(self.cacheSizeLimit) == int ? "
            f"self.cacheSizeLimit > 0 : self.cacheSizeLimit.matches('{BYTES_PATTERN}'))",
            "message": "cacheSizeLimit must be a byte quantity such as 32Gi, 500Mi or 20G",
            "fieldPath": ".cacheSizeLimit",
            "reason": "FieldValueInvalid",
        },
    ],
    "ModelArchitecture": [
        {
            "rule": "!has(self.numKeyValueHeads) || "
            "self.numAttentionHeads % self.numKeyValueHeads == 0",
            "message": "numKeyValueHeads must divide numAttentionHeads",
            "fieldPath": ".numKeyValueHeads",
        },
        {
            "rule": "has(self.numLocalExperts) == has(self.numExpertsPerTok)",
            "message": "numLocalExperts and numExpertsPerTok must be set together",
        },
    ],
}


def kept_when_stored(check: str) -> str:
    """A transition rule that refuses an update making a value fail `check` (written on
    `{x}`), and lets through one where the old value failed it too.

    For a check added after jobs were stored: a stored job that fails it must stay writable,
    or the upgraded cluster wedges a running job. The server evaluates the CRD's CEL rules on
    every write of the object, status and metadata included (kopf's annotations and
    finalizers, the operator's status patches), and spares an unchanged value only from
    Kubernetes 1.30 (ratcheting; on the status subresource from 1.33), and a suspend toggle
    changes the spec node a spec-wide rule sits on. A plain rule (or minLength) would refuse
    them all. A transition rule is not evaluated on create: a new job with the value is
    refused by the operator (InvalidSpec, naming the field) and `ftjob plan`; the API server
    could refuse it too only with `optionalOldSelf`, which servers before 1.30 (the chart
    claims 1.28) do not take. The spec is immutable, so "the old value failed too" is "the
    value is the stored one"."""
    new, old = check.format(x="self"), check.format(x="oldSelf")
    return f"({new}) || !({old})"


MERGE_LORA_CHECK = (
    "!has({x}.output) || !has({x}.output.mergeLora) || !{x}.output.mergeLora || "
    "(has({x}.method) && has({x}.method.type) && {x}.method.type != 'full')"
)

# Rules across parts of the spec (the spec's own, mirroring FineTuneJobSpec's validators).
SPEC_CEL_RULES: list[dict[str, Any]] = [
    {
        "rule": kept_when_stored(MERGE_LORA_CHECK),
        "message": "output.mergeLora needs method lora or qlora: a full fine-tune has no "
        "adapters to merge",
        "fieldPath": ".output.mergeLora",
    },
]

# Storage URIs: no `..` segments (spec.refuse_parent_segments), on the string itself.
URI_RULES: dict[str, list[dict[str, Any]]] = {
    "DatasetSpec": [
        {
            "rule": NO_PARENT_SEGMENTS_RULE,
            "message": "dataset.uri must not contain '..' path segments",
        }
    ],
    "CheckpointSpec": [
        {
            "rule": NO_PARENT_SEGMENTS_RULE,
            "message": "checkpoint.uri must not contain '..' path segments",
        }
    ],
    "OutputSpec": [
        {
            "rule": NO_PARENT_SEGMENTS_RULE,
            "message": "output.uri must not contain '..' path segments",
        },
        {
            # Not minLength: a schema bound cannot spare a job stored with "" (kept_when_stored).
            "rule": kept_when_stored("size({x}) > 0"),
            "message": "output.uri is empty: give a directory or s3:// URI, or omit it for "
            "no export",
        },
    ],
}

# int | "auto" fields: structural schemas allow exactly this one union.
INT_OR_AUTO_RULE = {
    "rule": f"type(self) == int ? self >= 1 && self <= {MAX_MICRO_BATCH} : self == 'auto'",
    "message": f"must be an integer from 1 to {MAX_MICRO_BATCH} or 'auto'",
}

# A quantity's bounds (int-or-string takes no type-specific keywords: CEL says them).
QUANTITY_RULE = {
    "rule": f"type(self) == int ? self >= 0 : size(self) <= {MAX_SHORT_STRING}",
    "message": f"must be a non-negative integer or a quantity string of at most "
    f"{MAX_SHORT_STRING} characters",
}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "GPUs", "type": "integer", "jsonPath": ".status.worldSize"},
    {"name": "Strategy", "type": "string", "jsonPath": ".status.strategy"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _resolve(node: Schema, defs: dict[str, Schema]) -> tuple[Schema, str | None]:
    """Follow a $ref; return the target schema and its def name."""
    ref = node.get("$ref")
    if ref is None:
        return node, None
    name = ref.rsplit("/", 1)[-1]
    return defs[name], name


def _strip_null(node: Schema) -> tuple[Schema, bool]:
    """`X | None` becomes X; returns whether null was allowed (an optional without default)."""
    options = node.get("anyOf")
    if not options:
        return node, False
    non_null = [o for o in options if o.get("type") != "null"]
    if len(non_null) == len(options) or len(non_null) != 1:
        return node, False
    merged = {k: v for k, v in node.items() if k != "anyOf"}
    merged.update(non_null[0])
    return merged, True


def _is_int_or_auto(node: Schema) -> bool:
    types = {o.get("type") for o in node.get("anyOf", [])}
    consts = [o.get("const") for o in node.get("anyOf", []) if "const" in o]
    return types == {"integer", "string"} and consts == ["auto"]


def _is_int_or_string(node: Schema) -> bool:
    """A Kubernetes quantity: integer or string, no constant."""
    options = [o for o in node.get("anyOf", []) if o.get("type") != "null"]
    return {o.get("type") for o in options} == {"integer", "string"} and not any(
        "const" in o for o in options
    )


def _convert(node: Schema, defs: dict[str, Schema]) -> Schema:
    # The field's own description/default win over those of the model it refers to.
    field_meta: Schema = {k: node[k] for k in ("description", "default") if k in node}
    node, def_name = _resolve(node, defs)
    node, _ = _strip_null(node)
    node, inner_name = _resolve(node, defs) if "$ref" in node else (node, None)
    def_name = def_name or inner_name
    node = {**node, **field_meta}
    if _is_int_or_auto(node) or _is_int_or_string(node):
        rule = INT_OR_AUTO_RULE if _is_int_or_auto(node) else QUANTITY_RULE
        out: Schema = {"x-kubernetes-int-or-string": True, "x-kubernetes-validations": [dict(rule)]}
        for key in ("description", "default"):
            if node.get(key) is not None:
                out[key] = node[key]
        return out

    out = {}
    if "description" in node:
        out["description"] = " ".join(str(node["description"]).split())
    if "const" in node:
        out["type"] = "string"
        out["enum"] = [node["const"]]
    elif "enum" in node:
        out["type"] = node.get("type", "string")
        out["enum"] = list(node["enum"])
    elif "type" in node:
        out["type"] = node["type"]
    elif node.get("properties") or def_name:
        out["type"] = "object"

    kind = out.get("type")
    if kind == "object":
        _convert_object(node, defs, out, def_name)
    elif kind == "array":
        out["items"] = _convert(node.get("items", {}), defs) if node.get("items") else {}
        if out["items"] == {}:
            out["items"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    bounds = ("minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems")
    for key in (*bounds, "minProperties", "maxProperties", "pattern"):
        if key in node:
            out[key] = node[key]
    # JSON Schema 2020-12 exclusive bounds are numbers; OpenAPI 3.0's are booleans.
    for excl, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if excl in node:
            out[plain] = node[excl]
            out[excl] = True
    if "default" in node and node["default"] is not None:
        out["default"] = node["default"]
    if def_name and def_name in CEL_RULES:
        out["x-kubernetes-validations"] = copy.deepcopy(CEL_RULES[def_name])
    return out


def _convert_object(
    node: Schema, defs: dict[str, Schema], out: Schema, def_name: str | None = None
) -> None:
    props = node.get("properties")
    if props:
        out["properties"] = {}
        required = set(node.get("required", []))
        for name, sub in props.items():
            converted = _convert(sub, defs)
            if name == "uri" and def_name in URI_RULES:
                converted["x-kubernetes-validations"] = copy.deepcopy(URI_RULES[def_name])
            # A nested model with a default_factory: default it to {} so the API server
            # fills in its own defaults too (pydantic emits no default for factories).
            is_model = "$ref" in sub and converted.get("type") == "object"
            if is_model and name not in required and "default" not in converted:
                converted["default"] = {}
            out["properties"][name] = converted
        if required:
            out["required"] = sorted(required)
    elif isinstance(node.get("additionalProperties"), dict) and node["additionalProperties"]:
        out["additionalProperties"] = _convert(node["additionalProperties"], defs)
    else:
        out["x-kubernetes-preserve-unknown-fields"] = True


# What may change once a job exists. Everything else is fixed at creation, as a Job's pod
# template is: running workers (and a restart, which re-reads the mounted job.json) must never
# see another generation's model, data or plan, or a group re-forms with ranks that disagree.
# To change a job, delete it and apply it again: it resumes from its checkpoints.
MUTABLE_SPEC_FIELDS = frozenset({"suspend"})
IMMUTABLE_SPEC_MESSAGE = (
    "spec is immutable once the job is created, except spec.suspend: running workers keep "
    "the spec they started with; to change it, delete the job and apply it again (it resumes "
    "from its checkpoints when the model and strategy are unchanged)"
)


def immutable_spec_rule(spec_schema: Schema) -> dict[str, str]:
    """A transition rule (checked on updates only) that fails when any spec field but
    MUTABLE_SPEC_FIELDS changes, appears or disappears. Equality is deep, unknown-field
    subtrees (affinity, deepspeedConfig) included: the API server compares those whole."""
    required = set(spec_schema.get("required", []))
    terms = []
    for name in spec_schema.get("properties", {}):
        if name in MUTABLE_SPEC_FIELDS:
            continue
        if name in required:
            terms.append(f"self.{name} == oldSelf.{name}")
        else:
            terms.append(
                f"(has(self.{name}) ? has(oldSelf.{name}) && self.{name} == oldSelf.{name}"
                f" : !has(oldSelf.{name}))"
            )
    return {"rule": " && ".join(terms), "message": IMMUTABLE_SPEC_MESSAGE}


def _model_schema(model: type[FineTuneJobSpec] | type[FineTuneJobStatus]) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _convert(raw, defs)


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
