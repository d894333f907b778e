"""Read FineTuneJob manifests from YAML, with errors that name the offending field.

A manifest is checked in the order a real cluster checks it: kubectl's YAML-to-JSON
(manifest_reader), the API server's object metadata and the CRD's structural schema
(schema_validation: unknown fields, types, bounds, CEL rules, defaults), then the operator's own
pydantic models. So `ftjob plan` refuses exactly what `kubectl apply` would, and plans the
object the operator would receive.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from finetune_operator.api.constants import API_VERSION, KIND
from finetune_operator.api.crd import build_crd
from finetune_operator.api.limits import job_name_problem
from finetune_operator.api.manifest_reader import (
    json_problems,
    parse_yaml_document,
    read_manifest_text,
)
from finetune_operator.api.schema_validation import CustomResourceSchema
from finetune_operator.api.spec import FineTuneJobSpec


def _show_path(path: str) -> str:
    """A field path for one line of output: quoted and escaped when a key holds spaces,
    control characters, quotes or colons (a manifest can use any string as a key)."""
    if not path:
        return "file"
    if all(char.isprintable() and not char.isspace() and char not in ':"' for char in path):
        return path
    return json.dumps(path)


class ManifestError(ValueError):
    """An invalid manifest: `problems` lists (field path, reason) pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(
            f"  {_show_path(path)}: " + reason.replace("\n", "\n    ") for path, reason in problems
        )
        super().__init__(f"{source} is not a valid {KIND}:\n{lines}")


@dataclass(frozen=True)
class Manifest:
    name: str
    namespace: str
    spec: FineTuneJobSpec
    metadata: dict[str, Any] = field(default_factory=dict)
    document: dict[str, Any] = field(default_factory=dict)  # the object as read: what kubectl sends


# pydantic puts the union member tried into the error location ("int", "literal['auto']");
# a user wants the field, with the reasons of every member joined.
_UNION_TAGS = frozenset({"int", "str", "float", "bool", "dict", "list", "none"})


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in _UNION_TAGS)


def format_validation_error(err: ValidationError, prefix: str = "spec") -> list[tuple[str, str]]:
    """pydantic errors as ('spec.resources.minNodes', 'reason') pairs (camelCase paths)."""
    merged: dict[str, list[str]] = {}
    for e in err.errors():
        parts = [str(p) for p in e["loc"] if not _is_union_tag(p)]
        path = ".".join([prefix, *parts])
        msg = e["msg"].removeprefix("Value error, ")
        merged.setdefault(path, []).append(msg)
    return [(path, "; or ".join(msgs)) for path, msgs in merged.items()]


def parse_spec(spec: Any, source: str = "manifest") -> FineTuneJobSpec:
    try:
        return FineTuneJobSpec.model_validate(spec)
    except ValidationError as err:
        raise ManifestError(source, format_validation_error(err)) from None


# metadata.name of a custom resource: a DNS-1123 subdomain; namespace: a DNS-1123 label.
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@lru_cache(maxsize=1)
def _crd_schema() -> CustomResourceSchema:
    version = build_crd()["spec"]["versions"][0]
    return CustomResourceSchema(version["schema"]["openAPIV3Schema"])


def _metadata_problems(metadata: Any) -> list[tuple[str, str]]:
    if metadata is None:
        return [("metadata.name", "Required value")]
    if not isinstance(metadata, dict):
        return [("metadata", f"must be an object, not a {type(metadata).__name__}")]
    name, namespace = metadata.get("name"), metadata.get("namespace")
    problems = []
    if not name:
        problems.append(("metadata.name", "Required value"))
    elif not isinstance(name, str) or len(name) > 253 or not _SUBDOMAIN.fullmatch(name):
        problems.append((
            "metadata.name",
            f"Invalid value: {name!r}: a lowercase RFC 1123 subdomain of at most 253 "
            "characters (a-z, 0-9, '-' and '.', starting and ending alphanumeric)",
        ))  # fmt: skip
    elif (operator_refuses := job_name_problem(name)) is not None:
        # The API server takes it; the operator refuses it (InvalidSpec).
        problems.append(("metadata.name", operator_refuses))
    if namespace is not None and (
        not isinstance(namespace, str) or len(namespace) > 63 or not _LABEL.fullmatch(namespace)
    ):
        problems.append((
            "metadata.namespace",
            f"Invalid value: {namespace!r}: a lowercase RFC 1123 label of at most 63 characters",
        ))  # fmt: skip
    return problems


# The names PEFT's LoraConfig and transformers' TrainingArguments give the same settings
# (lower-case, without underscores): a user coming from them writes these, and no spelling
# distance leads from `r` to `rank` or from `per_device_train_batch_size` to `microBatchSize`.
_ALIASES: dict[str, str] = {
    "r": "rank",
    "loraalpha": "alpha",
    "loradropout": "dropout",
    "lr": "learningRate",
    "perdevicetrainbatchsize": "microBatchSize",
    "maxseqlength": "sequenceLength",
    "maxseqlen": "sequenceLength",
    "maxlength": "sequenceLength",
    "numtrainepochs": "epochs",
    "lrschedulertype": "schedule",
    "torchdtype": "precision",
    "mixedprecision": "precision",
}


def _did_you_mean(path: str, schema: dict[str, Any]) -> str:
    """' (did you mean sequenceLength?)' for a key that is a misspelling, another case or the
    snake_case of a field beside it; '' when none is close. (kubectl names the field only.)"""
    parts = re.findall(r"\[[^\]]*\]|[^.\[]+", path)
    node: Any = schema
    for part in parts[:-1]:  # down to the mapping that holds the unknown key
        if part.startswith("["):
            node = node.get("items") or node.get("additionalProperties")
        else:
            node = node.get("properties", {}).get(part)
        if not isinstance(node, dict):
            return ""
    names = {name.lower(): name for name in node.get("properties", {})}
    last = parts[-1] if parts and not path.endswith(".") else ""  # a key "" ends in "."
    key = last.replace("_", "").lower()
    alias = _ALIASES.get(key)
    if alias and alias.lower() in names:  # an HF/PEFT name of a field this mapping has
        return f" (did you mean {alias}?)"
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.75)
    # The path is read back from text: a key with a point in it ("training.sequenceLength:"
    # under spec) reads as a path whose last part is a real field; naming it back would be no
    # help, and "" would suggest the mapping's own name.
    if not last or not close or names[close[0]] == last:
        return ""
    return f" (did you mean {names[close[0]]}?)"


def _schema_problems(doc: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The document as the API server stores it (defaulted), or its structural-schema errors.

    Unknown fields (snake_case keys, typos) are refused, as kubectl's default
    ``--validate=strict`` has the API server do; without it the server would prune them and
    plan and cluster would disagree.
    """
    schema = _crd_schema()
    unknown = [
        (path, "unknown field" + _did_you_mean(path, schema.schema))
        for path in schema.unknown_fields(doc)
    ]
    if unknown:
        return doc, unknown
    normalised = schema.normalise(doc)
    return normalised, schema.validate(normalised)


def parse_manifest(doc: Any, source: str = "manifest") -> Manifest:
    """One FineTuneJob, validated as the API server would and then as the operator does."""
    if not isinstance(doc, dict):
        raise ManifestError(source, [("", f"expected a YAML mapping, not {type(doc).__name__}")])
    problems = json_problems(doc)
    if doc.get("apiVersion") != API_VERSION:
        problems.append(("apiVersion", f"must be {API_VERSION}, got {doc.get('apiVersion')!r}"))
    if doc.get("kind") != KIND:
        problems.append(("kind", f"must be {KIND}, got {doc.get('kind')!r}"))
    problems += _metadata_problems(doc.get("metadata"))
    if "spec" not in doc:
        problems.append(("spec", "required"))
    if problems:
        raise ManifestError(source, problems)
    normalised, problems = _schema_problems(doc)
    if problems:
        raise ManifestError(source, problems)
    spec = parse_spec(normalised["spec"], source)
    metadata = doc["metadata"]
    return Manifest(
        name=str(metadata["name"]),
        namespace=str(metadata.get("namespace") or "default"),
        spec=spec,
        metadata=dict(metadata),
        document=doc,
    )


def load_manifest(path: str | Path) -> Manifest:
    """Read, parse and validate one FineTuneJob file; ManifestError for anything invalid."""
    text, problems = read_manifest_text(path)
    if text is None:
        raise ManifestError(str(path), problems)
    doc, problems = parse_yaml_document(text)
    if problems:
        raise ManifestError(str(path), problems)
    return parse_manifest(doc, str(path))
