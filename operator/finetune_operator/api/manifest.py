"""Read FineTuneJob manifests from YAML, with errors that name the offending field."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from finetune_operator.api.constants import API_VERSION, KIND
from finetune_operator.api.spec import FineTuneJobSpec


class ManifestError(ValueError):
    """An invalid manifest: `problems` lists (field path, reason) pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {path}: {reason}" for path, reason in problems)
        super().__init__(f"{source} is not a valid {KIND}:\n{lines}")


@dataclass(frozen=True)
class Manifest:
    name: str
    namespace: str
    spec: FineTuneJobSpec
    metadata: dict[str, Any] = field(default_factory=dict)


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


def parse_manifest(doc: Any, source: str = "manifest") -> Manifest:
    if not isinstance(doc, dict):
        raise ManifestError(source, [("", "expected a YAML mapping")])
    problems = []
    if doc.get("apiVersion") != API_VERSION:
        problems.append(("apiVersion", f"must be {API_VERSION}, got {doc.get('apiVersion')!r}"))
    if doc.get("kind") != KIND:
        problems.append(("kind", f"must be {KIND}, got {doc.get('kind')!r}"))
    metadata = doc.get("metadata") or {}
    if not metadata.get("name"):
        problems.append(("metadata.name", "required"))
    if "spec" not in doc:
        problems.append(("spec", "required"))
    if problems:
        raise ManifestError(source, problems)
    spec = parse_spec(doc["spec"], source)
    return Manifest(
        name=str(metadata["name"]),
        namespace=str(metadata.get("namespace") or "default"),
        spec=spec,
        metadata=dict(metadata),
    )


def load_manifest(path: str | Path) -> Manifest:
    text = Path(path).read_text()
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ManifestError(str(path), [("", f"not valid YAML: {err}")]) from None
    return parse_manifest(doc, str(path))
