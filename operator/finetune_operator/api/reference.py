"""The FineTuneJob field reference (docs/reference.md), generated from the CRD schema so it
can never drift from what the API server accepts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from finetune_operator.api.crd import build_crd
from finetune_operator.api.crd_rules import INT_OR_AUTO_RULE


def _type_of(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return (
            "int or `auto`"
            if INT_OR_AUTO_RULE in node["x-kubernetes-validations"]
            else "int or string"
        )
    kind = str(node.get("type", "object"))
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    if kind == "array":
        return f"[]{_type_of(node.get('items', {}))}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map[string]{_type_of(node['additionalProperties'])}"
    return kind


def _bounds(node: dict[str, Any]) -> str:
    parts = []
    if "minimum" in node:
        parts.append(("> " if node.get("exclusiveMinimum") else "≥ ") + str(node["minimum"]))
    if "maximum" in node:
        parts.append(("< " if node.get("exclusiveMaximum") else "≤ ") + str(node["maximum"]))
    if "minLength" in node:
        parts.append(f"length ≥ {node['minLength']}")
    if "maxLength" in node:
        parts.append(f"length ≤ {node['maxLength']}")
    if "maxItems" in node:
        parts.append(f"≤ {node['maxItems']} items")
    if "maxProperties" in node:
        parts.append(f"≤ {node['maxProperties']} entries")
    return ", ".join(parts)


def _rows(node: dict[str, Any], path: str, required: set[str]) -> Iterator[tuple[str, ...]]:
    for name, sub in node.get("properties", {}).items():
        here = f"{path}.{name}"
        default = sub.get("default")
        shown = "" if default is None or default == {} else f"`{json.dumps(default)}`"
        note = sub.get("description", "")
        rules = "; ".join(r["message"] for r in sub.get("x-kubernetes-validations", []))
        extra = "; ".join(x for x in (_bounds(sub), rules) if x)
        yield (
            f"`{here}`",
            _type_of(sub),
            "yes" if name in required else "",
            shown,
            note + (f" ({extra})" if extra else ""),
        )
        target = sub.get("items", sub) if sub.get("type") == "array" else sub
        if target.get("properties"):
            yield from _rows(
                target, here + ("[]" if target is not sub else ""), set(target.get("required", []))
            )


def render_reference() -> str:
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    lines = [
        "# FineTuneJob reference",
        "",
        "Generated from the CRD (`ftjob crd`) by `python -m finetune_operator.api.reference`;",
        "do not edit by hand. `kubectl explain finetunejob.spec.<field>` shows the same text.",
        "",
    ]
    for section in ("spec", "status"):
        node = root["properties"][section]
        lines += [
            f"## {section}",
            "",
            "| field | type | required | default | description |",
            "|---|---|---|---|---|",
        ]
        lines += [
            "| "
            + " | ".join(cell.replace("|", "\\|") if i != 1 else cell for i, cell in enumerate(row))
            + " |"
            for row in _rows(node, section, set(node.get("required", [])))
        ]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_reference(), end="")
