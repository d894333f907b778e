"""Bytes of a manifest file to one JSON-compatible document, refusing what kubectl refuses.

kubectl turns YAML into JSON before anything reaches the API server, so a manifest is valid
only if it is UTF-8, parses as YAML, and its values are JSON values: no NaN or infinity, no
binary, sets or non-string keys. Like kubectl, empty documents (a trailing ``---``, a file of
comments) are skipped and a ``kind: List`` is unwrapped; a file must then hold exactly one
object, since `ftjob plan` plans one job.
"""

from __future__ import annotations

import math
import re
import struct
import warnings
from pathlib import Path
from typing import Any

import yaml

from finetune_operator.api import limits

Problem = tuple[str, str]


# libyaml when PyYAML has it: the pure-Python scanner is ~10x slower on large input.
_BaseLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


_GO_SHORTEST_G_EXPONENT = 6  # strconv.FormatFloat(f, 'g', -1, ...): eprec = 6 when shortest


def _go_float_key(value: float) -> str:
    """A float key as sigs.k8s.io/yaml writes it: strconv.FormatFloat(f, 'g', -1, 32), the
    shortest text of its float32, with go-yaml's names for infinities and NaN."""
    if math.isnan(value):
        return ".nan"
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    single = struct.unpack("f", struct.pack("f", value))[0]
    digits = next(
        (
            d
            for d in range(1, 10)
            if struct.unpack("f", struct.pack("f", float(f"{single:.{d - 1}e}")))[0] == single
        ),
        9,
    )
    exponent = int(f"{single:.{digits - 1}e}".partition("e")[2])
    # Go's shortest %g switches to an exponent at 1e6 (Python's %g only at the digits'
    # count: 10.0 would be "1e+01", 1234567.0 "1234567"; Go writes "10", "1.234567e+06").
    if exponent < -4 or exponent >= _GO_SHORTEST_G_EXPONENT:
        return f"{single:.{digits - 1}e}"
    return f"{single:.{max(digits - 1 - exponent, 0)}f}"


def _kubectl_key(key: Any) -> Any:
    """The JSON key kubectl sends for a YAML key (sigs.k8s.io/yaml's map key conversion): a
    boolean becomes "true"/"false", a number its decimal text; any other non-string stays,
    for json_problems to refuse as kubectl does ('unsupported map key')."""
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, int):
        return str(key)
    if isinstance(key, float):
        return _go_float_key(key)
    return key


class _Loader(_BaseLoader):  # type: ignore[valid-type,misc]
    """YAML as kubectl reads it: timestamps stay strings (sigs.k8s.io/yaml goes through JSON,
    which has no date type), so `revision: 2024-01-01` is the string it looks like; a key
    given twice in one mapping is refused (kubectl: 'mapping key "x" already defined'), where
    a YAML 1.1 reader would keep the last value silently. A boolean or number key becomes the
    string kubectl makes of it (`on:` and `y:` are the key "true"), with a warning for the
    words that are not `true`/`false`: the name is not what it looks like."""

    key_warnings: list[str]  # filled by parse_yaml_document's loader, shown as warnings

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, yaml.MappingNode):
            return dict(super().construct_mapping(node, deep=deep))
        # Keys by kubectl's name for them, built here: a Python dict would merge `y`, `true`
        # and `1` (True == 1) before any conversion.
        first: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            # Merge keys (<<) may override; only keys written out in this mapping count.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            name = self._key_name(key_node)
            seen = first.setdefault(name, key_node)
            if seen is not key_node:
                same = seen.value == key_node.value
                raise yaml.constructor.ConstructorError(
                    None, None,
                    f'mapping key "{key_node.value}" already defined at line '
                    f"{seen.start_mark.line + 1}"
                    + ("" if same else f' (as "{seen.value}": both are the key "{name}" to kubectl)'),
                    key_node.start_mark,
                )  # fmt: skip
            self._warn_boolean_key(key_node, name)
        self.flatten_mapping(node)
        mapping: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    "found unhashable key", key_node.start_mark,
                ) from None  # fmt: skip
            mapping[self._key_name(key_node)] = self.construct_object(value_node, deep=deep)
        return mapping

    def _key_name(self, key_node: yaml.Node) -> Any:
        # A float key stays a float (go-yaml decodes it to float64): the values' rule that
        # an integral float is an integer (Go's JSON encoder) is not kubectl's for keys.
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag.endswith(":float"):
            return _go_float_key(yaml.SafeLoader.construct_yaml_float(self, key_node))
        return _kubectl_key(self.construct_object(key_node))

    def _warn_boolean_key(self, key_node: yaml.ScalarNode, name: Any) -> None:
        if key_node.tag.endswith(":bool") and key_node.value.lower() not in ("true", "false"):
            self.key_warnings.append(
                f"line {key_node.start_mark.line + 1}: key {key_node.value} is the boolean "
                f'{name} to kubectl (YAML 1.1), so the field is named "{name}"; quote it '
                f"('{key_node.value}':) to name it {key_node.value}"
            )


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# go-yaml v2's float syntax (sigs.k8s.io/yaml, what kubectl parses with): no dot needed, an
# unsigned exponent allowed (`3e-3`, `1e2`, `1.5e3`), all strings to a YAML 1.1 reader. Tried
# after the int resolvers, as go-yaml tries an int first.
_GO_YAML_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$")
for _first in "+-.0123456789":
    _Loader.yaml_implicit_resolvers[_first] = [
        *_Loader.yaml_implicit_resolvers.get(_first, []),
        ("tag:yaml.org,2002:float", _GO_YAML_FLOAT),
    ]
# go-yaml v2 reads y/Y/n/N as booleans too (besides YAML 1.1's yes/no/on/off/true/false).
_GO_YAML_SHORT_BOOL = re.compile(r"^(?:y|Y|n|N)$")
for _first in "yYnN":
    _Loader.yaml_implicit_resolvers[_first] = [
        ("tag:yaml.org,2002:bool", _GO_YAML_SHORT_BOOL),
        *_Loader.yaml_implicit_resolvers.get(_first, []),
    ]


def _construct_bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> bool:
    text = loader.construct_scalar(node)
    if isinstance(text, str) and text in ("y", "Y", "n", "N"):
        return text in ("y", "Y")
    return bool(yaml.SafeLoader.construct_yaml_bool(loader, node))


_Loader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
# Go's JSON encoder writes an integral float64 below 1e21 without a fraction (60.0 -> 60), so
# the API server receives an integer: so does our reader.
_GO_JSON_INTEGRAL_BELOW = 1e21


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float | int:
    value = yaml.SafeLoader.construct_yaml_float(loader, node)
    if math.isfinite(value) and value.is_integer() and abs(value) < _GO_JSON_INTEGRAL_BELOW:
        return int(value)
    return value


_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)
_BRACKETS = str.maketrans("", "", "".join(chr(c) for c in range(128) if chr(c) not in "[]{}"))


def _flow_depth(text: str) -> int:
    """An upper bound of the flow-collection nesting ([ and {), quotes ignored: YAML scanners
    slow down with the square of it, so a file of brackets must be refused before parsing."""
    depth = deepest = 0
    for char in text.translate(_BRACKETS):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1  # below zero only in strings: harmless for an upper bound
    return deepest


def read_manifest_text(path: str | Path) -> tuple[str | None, list[Problem]]:
    """The file's text, or why it cannot be read (missing, a directory, not UTF-8, too big)."""
    target = Path(path)
    try:
        if target.is_dir():
            return None, [("", "is a directory, not a manifest file")]
        with target.open("rb") as handle:
            raw = handle.read(limits.MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        return None, [("", "no such file")]
    except OSError as err:
        return None, [("", f"cannot be read: {err.strerror or err}")]
    if len(raw) > limits.MAX_MANIFEST_BYTES:
        return None, [("", f"is larger than {limits.MAX_MANIFEST_BYTES} bytes")]
    try:
        return raw.decode("utf-8"), []
    except UnicodeDecodeError as err:
        return None, [("", f"is not UTF-8 text (byte {err.start}: {raw[err.start]:#04x})")]


def _load_all(text: str, key_warnings: list[str]) -> list[Any]:
    loader = _Loader(text)
    loader.key_warnings = key_warnings
    try:
        docs = []
        while loader.check_data():
            docs.append(loader.get_data())
        return docs
    finally:
        loader.dispose()


def parse_yaml_document(text: str) -> tuple[Any, list[Problem]]:
    """The single object in the text (empty documents skipped, a List unwrapped)."""
    if _flow_depth(text) > limits.MAX_NESTING:
        return None, [("", f"nested deeper than {limits.MAX_NESTING} levels")]
    key_warnings: list[str] = []
    try:
        docs = [doc for doc in _load_all(text, key_warnings) if doc is not None]
    except yaml.YAMLError as err:
        # PyYAML names the text it was given "<unicode string>": the caller names the file.
        where = str(err).replace('in "<unicode string>", ', "at ")
        return None, [("", f"not valid YAML: {where}")]
    except RecursionError:
        return None, [("", f"nested deeper than {limits.MAX_NESTING} levels")]
    for message in key_warnings:
        warnings.warn(message, UserWarning, stacklevel=2)
    if len(docs) == 1 and isinstance(docs[0], dict) and docs[0].get("kind") == "List":
        items = docs[0].get("items")
        docs = items if isinstance(items, list) else [docs[0]]
        if not docs:  # not "empty, or only comments": the file holds a List
            return None, [("", "holds a List with no items: plan one FineTuneJob per file")]
    if not docs:
        return None, [("", "holds no object (empty, or only comments and '---')")]
    if len(docs) > 1:
        return None, [("", f"holds {len(docs)} objects; plan one FineTuneJob per file")]
    return docs[0], json_problems(docs[0])


def json_problems(doc: Any) -> list[Problem]:
    """Where the document is not a JSON value kubectl could send (the first few places).

    Iterative, with a budget of values: YAML aliases can make a small file expand into a
    huge tree ("billion laughs"), which kubectl refuses and which must not hang the caller.
    """
    found: list[Problem] = []
    stack: list[tuple[Any, str, int]] = [(doc, "", 0)]
    visited = 0
    while stack and len(found) < 10:
        value, path, depth = stack.pop()
        visited += 1
        if visited > limits.MAX_MANIFEST_VALUES:
            return [("", f"expands to more than {limits.MAX_MANIFEST_VALUES} values")]
        if depth > limits.MAX_NESTING:
            found.append((path, f"nested deeper than {limits.MAX_NESTING} levels"))
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str):
                    stack.append((item, f"{path}.{key}" if path else key, depth + 1))
                else:
                    found.append((path, f"key {key!r} is not a string"))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            found.append((path, f"{value} is not a number JSON can carry (no NaN or infinity)"))
        elif not (value is None or isinstance(value, str | int | float | bool)):
            found.append((path, f"a YAML {type(value).__name__} is not a JSON value"))
    return sorted(found)
