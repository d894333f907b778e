"""Hypothesis strategies: malformed FineTuneJob manifests made by mutating the examples."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from tests.conftest import EXAMPLES

Path_ = tuple[str | int, ...]

EXAMPLE_DOCS: list[dict[str, Any]] = [
    yaml.safe_load(path.read_text()) for path in sorted(Path(EXAMPLES).glob("*.yaml"))
]

# Values a user (or an attacker) might put anywhere: wrong types, huge and non-finite numbers,
# unicode and control characters, empty and nested containers.
_SCALARS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 10**18, 10**55, 2**63, 2**64 + 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e55, 1e-300, 0.5, -0.0]),
    st.booleans(),
    st.none(),
    st.text(max_size=40),
    st.sampled_from(
        ["", "auto", "\n", "a\nb", "..", "../../etc", "/abs", "Ünïcødé", "\u202e", "x" * 300]
    ),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)


def _deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"a": value}
    return value


VALUES = st.one_of(_VALUES, st.integers(1, 200).map(_deep))


def paths(node: Any, prefix: Path_ = ()) -> list[Path_]:
    """Every path to a value in the document (dict keys and list indices)."""
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += paths(value, (*prefix, index))
    return found


def _parent(doc: Any, path: Path_) -> Any:
    node = doc
    for part in path[:-1]:
        node = node[part]
    return node


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name)


@st.composite
def mutation(draw: st.DrawFn, doc: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """One mutation of a copy of doc; returns it and a description (for failure reports)."""
    doc = copy.deepcopy(doc)
    path = draw(st.sampled_from([p for p in paths(doc) if p]))
    parent, leaf = _parent(doc, path), path[-1]
    kind = draw(st.sampled_from(["replace", "delete", "extra", "snake", "wrap"]))
    where = ".".join(str(p) for p in path)
    if kind == "replace":
        parent[leaf] = draw(VALUES)
    elif kind == "delete":
        del parent[leaf]
    elif kind == "extra" and isinstance(parent[leaf], dict):
        parent[leaf][draw(st.text(min_size=1, max_size=20))] = draw(VALUES)
    elif kind == "snake" and isinstance(parent, dict) and isinstance(leaf, str):
        parent[_snake(leaf)] = parent.pop(leaf)
    else:
        parent[leaf] = [parent[leaf]]  # the right value, in a list
    return doc, f"{kind} {where}"


@st.composite
def malformed_manifest(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """An example manifest with one to three mutations."""
    doc: dict[str, Any] = draw(st.sampled_from(EXAMPLE_DOCS))
    done = []
    for _ in range(draw(st.integers(1, 3))):
        if not isinstance(doc, dict) or not paths(doc)[1:]:
            break
        doc, what = draw(mutation(doc))
        done.append(what)
    return doc, "; ".join(done)


@st.composite
def corrupted_bytes(draw: st.DrawFn) -> bytes:
    """An example's YAML with bytes flipped, inserted or cut: what a bad copy or editor makes."""
    text = yaml.safe_dump(draw(st.sampled_from(EXAMPLE_DOCS)), allow_unicode=True).encode()
    data = bytearray(text)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "insert", "cut"]))
        if op == "flip":
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at : at + draw(st.integers(1, 200))]
    return bytes(data)
