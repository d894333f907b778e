"""Structural-schema handling of custom resources, in the order a real API server applies it.

Shared by `ftjob plan` (which must refuse exactly what the API server refuses) and the local
cluster's API server, so that the two can never disagree.

1. **Prune** fields the CRD's ``openAPIV3Schema`` does not declare (unless the node says
   ``x-kubernetes-preserve-unknown-fields``): the operator's status fields that are not in the
   schema silently vanish here, exactly as they would on a real cluster.
2. **Default** absent properties from ``default`` (only inside objects that exist).
3. **Validate** with ``jsonschema`` (OpenAPI v3.0 is draft-4-like, e.g. boolean
   ``exclusiveMinimum``), after translating the Kubernetes extensions
   (``x-kubernetes-int-or-string``, ``nullable``).
4. **Evaluate** ``x-kubernetes-validations`` CEL rules with ``cel-python``; rules that use
   ``oldSelf`` (transition rules) run on updates only.

Errors come back as ``(field path, message)`` pairs in the wording of the real server, so that
``kubectl`` users and tests see the same text.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from typing import Any

import celpy
import jsonschema
from celpy.adapter import json_to_cel

Schema = dict[str, Any]
FieldError = tuple[str, str]

# Keys of the OpenAPI schema that jsonschema understands the same way (draft 4).
_PASSTHROUGH = (
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "uniqueItems",
    "minProperties",
    "maxProperties",
    "multipleOf",
    "required",
)


def prune(value: Any, schema: Schema, *, root: bool = False) -> Any:
    """Drop undeclared fields; ``apiVersion``, ``kind`` and ``metadata`` are the server's own."""
    if isinstance(value, dict) and schema.get("type", "object") == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
            return value
        props: dict[str, Schema] = schema.get("properties", {})
        additional = schema.get("additionalProperties")
        result: dict[str, Any] = {}
        for key, item in value.items():
            if root and key in ("apiVersion", "kind", "metadata"):
                result[key] = item
            elif key in props:
                result[key] = prune(item, props[key])
            elif isinstance(additional, dict):
                result[key] = prune(item, additional)
            elif additional is True or schema.get("x-kubernetes-preserve-unknown-fields"):
                result[key] = item
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(item, schema["items"]) for item in value]
    return value


def unknown_fields(value: Any, schema: Schema, path: str = "", *, root: bool = False) -> list[str]:
    """Paths of the fields `prune` would drop: what ``kubectl --validate=strict`` (its default)
    refuses as ``unknown field``, and what the API server prunes without it."""
    found: list[str] = []
    if isinstance(value, dict) and schema.get("type", "object") == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
            return found
        props: dict[str, Schema] = schema.get("properties", {})
        additional = schema.get("additionalProperties")
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if root and key in ("apiVersion", "kind", "metadata"):
                continue
            if key in props:
                found += unknown_fields(item, props[key], where)
            elif isinstance(additional, dict):
                found += unknown_fields(item, additional, f"{path}[{key}]")
            elif not (additional is True or schema.get("x-kubernetes-preserve-unknown-fields")):
                found.append(where)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{path}[{index}]")
    return found


def apply_defaults(value: Any, schema: Schema) -> Any:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(value[key], sub)
        additional = schema.get("additionalProperties")
        if isinstance(additional, dict):
            for key in set(value) - set(schema.get("properties", {})):
                value[key] = apply_defaults(value[key], additional)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def to_json_schema(schema: Schema) -> Schema:
    """Translate one structural-schema node (and its children) into draft-4 JSON Schema."""
    out: Schema = {k: schema[k] for k in _PASSTHROUGH if k in schema}
    kind = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    elif kind:
        out["type"] = [kind, "null"] if schema.get("nullable") else kind
    if "properties" in schema:
        out["properties"] = {k: to_json_schema(v) for k, v in schema["properties"].items()}
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        out["items"] = to_json_schema(schema["items"])
    for combinator in ("allOf", "anyOf", "oneOf"):
        if combinator in schema:
            out.setdefault("allOf", []).append(
                {combinator: [to_json_schema(s) for s in schema[combinator]]}
            )
    if "not" in schema:
        out["not"] = to_json_schema(schema["not"])
    return out


def _path(parts: Any) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    return json.dumps(value)


def _describe(error: jsonschema.ValidationError) -> FieldError:
    """Word a jsonschema error as the Kubernetes API server does."""
    path = _path(error.absolute_path)
    value = error.instance
    if error.validator == "required":
        missing = str(error.message).split("'")[1]
        return (f"{path}.{missing}" if path else missing, "Required value")
    if error.validator == "enum":
        allowed = ", ".join(json.dumps(v) for v in error.validator_value)
        return (path, f"Unsupported value: {_show(value)}: supported values: {allowed}")
    if error.validator in ("type", "anyOf"):
        wanted = error.validator_value if error.validator == "type" else "integer or string"
        if isinstance(wanted, list):
            wanted = wanted[0]
        return (
            path,
            f"Invalid value: {_show(value)}: {path} in body must be of type {wanted}: {_show(value)}",
        )
    words = {
        "minimum": "should be greater than or equal to",
        "maximum": "should be less than or equal to",
        "minLength": "should be at least",
        "maxLength": "may not be longer than",
        "minItems": "should have at least",
        "maxItems": "must have at most",
        "pattern": "should match",
    }
    if error.validator in ("minimum", "maximum") and error.schema.get(
        "exclusiveMinimum" if error.validator == "minimum" else "exclusiveMaximum"
    ):
        above = "greater" if error.validator == "minimum" else "less"
        bound = error.validator_value
        return (
            path,
            f"Invalid value: {_show(value)}: {path} in body should be {above} than {bound}",
        )
    if error.validator in words:
        bound = error.validator_value
        return (
            path,
            f"Invalid value: {_show(value)}: {path} in body {words[str(error.validator)]} {bound}",
        )
    return (path, f"Invalid value: {_show(value)}: {error.message}")


@lru_cache(maxsize=256)
def _cel_program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _cel_rules(value: Any, old: Any, schema: Schema, path: str, errors: list[FieldError]) -> None:
    for item in schema.get("x-kubernetes-validations", []):
        rule = item["rule"]
        if "oldSelf" in rule and old is None:
            continue  # transition rules only apply when there is an old value
        activation = {"self": json_to_cel(value)}
        if old is not None:
            activation["oldSelf"] = json_to_cel(old)
        field = path + item.get("fieldPath", "")
        try:
            ok = _cel_program(rule).evaluate(activation)
        except Exception as exc:  # celpy raises its own evaluation errors
            errors.append((field, f"Invalid value: {_show(value)}: rule evaluation error: {exc}"))
            continue
        if not isinstance(ok, bool) and isinstance(ok, Exception):
            errors.append((field, f"Invalid value: {_show(value)}: rule evaluation error: {ok}"))
        elif not ok:
            message = item.get("message") or f"failed rule: {rule}"
            errors.append((field, f"Invalid value: {_show(value)}: {message}"))
    old_map = old if isinstance(old, dict) else {}
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _cel_rules(
                    value[key], old_map.get(key), sub, f"{path}.{key}" if path else key, errors
                )
        additional = schema.get("additionalProperties")
        if isinstance(additional, dict):
            for key in set(value) - set(schema.get("properties", {})):
                _cel_rules(value[key], old_map.get(key), additional, f"{path}[{key}]", errors)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item_value in enumerate(value):
            _cel_rules(item_value, None, schema["items"], f"{path}[{index}]", errors)


class CustomResourceSchema:
    """The validation of one served version of a CRD."""

    def __init__(self, openapi_schema: Schema) -> None:
        self.schema = openapi_schema
        json_schema = to_json_schema(openapi_schema)
        # metadata is validated by the server itself (name rules), not by the CRD's schema.
        json_schema.get("properties", {}).pop("metadata", None)
        self._validator = jsonschema.Draft4Validator(json_schema)

    def unknown_fields(self, obj: dict[str, Any]) -> list[str]:
        return unknown_fields(obj, self.schema, root=True)

    def normalise(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Prune unknown fields and apply defaults; returns a new object."""
        pruned = prune(copy.deepcopy(obj), self.schema, root=True)
        result: dict[str, Any] = apply_defaults(pruned, self.schema)
        return result

    def validate(self, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[FieldError]:
        errors = [_describe(e) for e in self._validator.iter_errors(obj)]
        if errors:
            return sorted(set(errors))  # CEL needs a schema-valid object to mean anything
        body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
        old_body = {
            k: v for k, v in (old or {}).items() if k not in ("apiVersion", "kind", "metadata")
        }
        _cel_rules(body, old_body if old else None, self.schema, "", errors)
        return errors
