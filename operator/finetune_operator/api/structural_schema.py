"""Pydantic's JSON Schema 2020-12 made into the *structural* OpenAPI v3.0 schema a CRD needs.

No $refs, no anyOf of different types (except int-or-string), boolean exclusive bounds,
explicit types everywhere; the CEL rules of :mod:`.crd_rules` go where their model or field is.
"""

from __future__ import annotations

import copy

from finetune_operator.api.crd_rules import (
    CEL_RULES,
    INT_OR_AUTO_RULE,
    QUANTITY_RULE,
    URI_RULES,
    Schema,
)


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


def convert(node: Schema, defs: dict[str, Schema]) -> Schema:
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
        out["items"] = convert(node.get("items", {}), defs) if node.get("items") else {}
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
            converted = convert(sub, defs)
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
        out["additionalProperties"] = convert(node["additionalProperties"], defs)
    else:
        out["x-kubernetes-preserve-unknown-fields"] = True
