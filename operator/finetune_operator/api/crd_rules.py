"""The CRD's CEL rules: what the API server checks that a structural schema cannot say.

Each rule mirrors a pydantic validator (spec.py and the models it uses), so the operator and
the API server refuse the same manifests. :mod:`.structural_schema` places them in the schema
(per model, per storage URI, per int-or-string field); :mod:`.crd` adds the spec-wide ones.
"""

from __future__ import annotations

from typing import Any

from finetune_operator.api.limits import MAX_MICRO_BATCH, MAX_SHORT_STRING
from finetune_operator.api.quantity import BYTES_PATTERN
from finetune_operator.api.spec import NO_PARENT_SEGMENTS_RULE

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
