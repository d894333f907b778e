"""Label and field selectors as the Kubernetes API server parses them.

Label selectors support ``=``, ``==``, ``!=``, ``in (...)``, ``notin (...)``, ``key`` (exists) and
``!key`` (does not exist), comma-separated (a comma inside ``(...)`` separates values, not terms).
Field selectors support ``=``, ``==`` and ``!=`` on any dotted path of the object: a real server
accepts only a few fields per kind and answers 400 for others; being more permissive here cannot
make a correct client fail.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_SET_TERM = re.compile(r"^\s*([^\s!=(),]+)\s+(in|notin)\s*\(([^)]*)\)\s*$")
_EQ_TERM = re.compile(r"^\s*([^\s!=(),]+)\s*(==|=|!=)\s*([^\s,()]*)\s*$")
_EXISTS_TERM = re.compile(r"^\s*(!?)\s*([^\s!=(),]+)\s*$")


class SelectorError(ValueError):
    """A selector the server cannot parse (answered with 400 BadRequest)."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # one of: =, !=, in, notin, exists, !exists
    values: frozenset[str]

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        # != and notin also match objects that lack the key, as in Kubernetes.
        return not present or value not in self.values


def _split_terms(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    terms: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return [term for term in terms if term.strip()]


def parse_label_selector(text: str | None) -> list[Requirement]:
    """Parse a ``labelSelector`` query parameter; an empty selector matches everything."""
    requirements: list[Requirement] = []
    for term in _split_terms(text or ""):
        if match := _SET_TERM.match(term):
            key, op, raw = match.groups()
            values = frozenset(v.strip() for v in raw.split(",") if v.strip())
            requirements.append(Requirement(key, op, values))
        elif match := _EQ_TERM.match(term):
            key, op, value = match.groups()
            requirements.append(Requirement(key, "!=" if op == "!=" else "=", frozenset({value})))
        elif match := _EXISTS_TERM.match(term):
            negated, key = match.groups()
            requirements.append(Requirement(key, "!exists" if negated else "exists", frozenset()))
        else:
            raise SelectorError(f"unable to parse requirement: {term.strip()!r}")
    return requirements


def selector_from_match_labels(match_labels: Mapping[str, str]) -> list[Requirement]:
    """The requirements of a Service-style ``selector`` map (every key must equal)."""
    return [Requirement(k, "=", frozenset({v})) for k, v in match_labels.items()]


def labels_match(requirements: list[Requirement], obj: Mapping[str, Any]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(req.matches(labels) for req in requirements)


@dataclass(frozen=True)
class FieldRequirement:
    path: tuple[str, ...]
    value: str
    negated: bool

    def matches(self, obj: Mapping[str, Any]) -> bool:
        current: Any = obj
        for part in self.path:
            current = current.get(part) if isinstance(current, Mapping) else None
        # Absent fields compare as the empty string, as the server's field sets do.
        actual = "" if current is None else str(current)
        if isinstance(current, bool):
            actual = str(current).lower()
        return (actual == self.value) != self.negated


def parse_field_selector(text: str | None) -> list[FieldRequirement]:
    requirements: list[FieldRequirement] = []
    for term in _split_terms(text or ""):
        match = _EQ_TERM.match(term)
        if not match:
            raise SelectorError(f"invalid field selector: {term.strip()!r}")
        path, op, value = match.groups()
        requirements.append(FieldRequirement(tuple(path.split(".")), value, op == "!="))
    return requirements


def fields_match(requirements: list[FieldRequirement], obj: Mapping[str, Any]) -> bool:
    return all(req.matches(obj) for req in requirements)
