"""Specs stored under an older operator that this release refuses for new jobs.

A release that starts refusing a spec must not turn a job that already runs into
InvalidSpec when the upgraded operator reconciles it (or when its trainer re-reads
job.json on a restart): the job would die for a field it was accepted with. The API
server keeps such a job writable: its CRD rules for them are transition rules
(crd_rules.kept_when_stored); here
the operator and the trainer give it the meaning it had when it was accepted, and say
what to change. A new job with the same spec is still refused, naming the field.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Deprecation:
    """A stored spec form kept with its old meaning: the field, and what to change."""

    field: str
    message: str


def _output_uri_empty(spec: dict[str, Any]) -> Deprecation | None:
    output = spec.get("output")
    if not isinstance(output, dict) or output.get("uri") != "":
        return None
    del output["uri"]  # taken as unset before: no export
    return Deprecation(
        "spec.output.uri",
        'spec.output.uri is "" and is read as unset (no export), as before; remove it or '
        "give a directory or s3:// URI (a new job with it is refused)",
    )


def _merge_lora_on_full(spec: dict[str, Any]) -> Deprecation | None:
    output, method = spec.get("output"), spec.get("method")
    method_type = method.get("type", "full") if isinstance(method, dict) else "full"
    if not isinstance(output, dict) or output.get("mergeLora") is not True:
        return None
    if method_type != "full":
        return None
    output["mergeLora"] = False  # accepted and ignored before: a full fine-tune has no adapters
    return Deprecation(
        "spec.output.mergeLora",
        "spec.output.mergeLora is true with method.type full and is ignored (the whole "
        "weights are exported), as before; remove output.mergeLora (a new job with it is "
        "refused)",
    )


_RULES = (_output_uri_empty, _merge_lora_on_full)


def accept_stored_spec(raw: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[Deprecation, ...]]:
    """The spec of an already accepted job with its refused-now forms given their old
    meaning, and one Deprecation per form found. For jobs the operator has planned before
    (and job.json, written only for those); a new job's spec is validated as it is."""
    spec = copy.deepcopy(dict(raw))
    found = tuple(d for rule in _RULES if (d := rule(spec)) is not None)
    return spec, found


def describe_deprecations(found: tuple[Deprecation, ...]) -> str:
    return "deprecated spec kept running: " + "; ".join(d.message for d in found)
