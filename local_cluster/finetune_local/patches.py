"""The patch formats the API server accepts: JSON merge, strategic merge, JSON patch.

Strategic merge patch is approximated: lists whose items are objects are merged by the merge key
that the built-in Go types declare for the common fields (``name`` for containers, env, volumes,
volume mounts; ``containerPort``/``port`` for ports; ``type`` for conditions); other lists are
replaced, and ``$patch: delete``/``$patch: replace`` directives are honoured. Custom resources
do not accept strategic merge patches (415), exactly as on a real server.
"""

from __future__ import annotations

import copy
from typing import Any

# Field name -> merge key, from the `patchMergeKey` tags of k8s.io/api types.
_MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "ports": "containerPort",
    "conditions": "type",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "ownerReferences": "uid",
}


class PatchError(ValueError):
    """A patch that cannot be applied (422 for a failed test op, 400 for a malformed patch)."""

    def __init__(self, message: str, *, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, field: str = "") -> Any:
    if isinstance(patch, list):
        return _merge_list(target, patch, field)
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$") or key.startswith("$setElementOrder/"):
            continue  # directives we do not need: element order, retainKeys
        if value is None:
            result.pop(key, None)
        else:
            result[key] = strategic_merge_patch(result.get(key), value, key)
    return result


def _merge_list(target: Any, patch: list[Any], field: str) -> list[Any]:
    key = _MERGE_KEYS.get(field)
    if key == "containerPort" and any(isinstance(i, dict) and "port" in i for i in patch):
        key = "port"  # Service ports merge by port, container ports by containerPort
    if key is None or not isinstance(target, list) or not all(isinstance(i, dict) for i in patch):
        return [i for i in copy.deepcopy(patch) if not (isinstance(i, dict) and "$patch" in i)]
    result: list[Any] = [copy.deepcopy(i) for i in target]
    for item in patch:
        index = next(
            (
                n
                for n, old in enumerate(result)
                if isinstance(old, dict) and old.get(key) == item.get(key)
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(copy.deepcopy(item))
        else:
            result[index] = strategic_merge_patch(result[index], item, field)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}", status=400)
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _resolve(doc: Any, parts: list[str], path: str) -> Any:
    for part in parts:
        if isinstance(doc, dict) and part in doc:
            doc = doc[part]
        elif isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        else:
            raise PatchError(f"path {path!r} does not exist")
    return doc


def _add(doc: Any, parts: list[str], value: Any, path: str) -> Any:
    if not parts:
        return value
    parent = _resolve(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        index = len(parent) if last == "-" else int(last) if last.isdigit() else -1
        if not 0 <= index <= len(parent):
            raise PatchError(f"index out of range in {path!r}")
        parent.insert(index, value)
    else:
        raise PatchError(f"cannot add at {path!r}")
    return doc


def _remove(doc: Any, parts: list[str], path: str) -> Any:
    if not parts:
        raise PatchError("cannot remove the whole document")
    parent = _resolve(doc, parts[:-1], path)
    _resolve(parent, parts[-1:], path)  # existence check: RFC 6902 requires it
    if isinstance(parent, dict):
        del parent[parts[-1]]
    else:
        del parent[int(parts[-1])]
    return doc


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902; a failed ``test`` raises 422, which kopf relies on for optimistic concurrency."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations", status=400)
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"malformed JSON patch operation: {op!r}", status=400)
        path = op["path"]
        parts = _pointer(path)
        kind = op["op"]
        if kind == "test":
            if _resolve(doc, parts, path) != op.get("value"):
                raise PatchError(f"testing value {path} failed")
        elif kind == "add":
            doc = _add(doc, parts, copy.deepcopy(op.get("value")), path)
        elif kind == "remove":
            doc = _remove(doc, parts, path)
        elif kind == "replace":
            doc = _remove(doc, parts, path) if parts else doc
            doc = _add(doc, parts, copy.deepcopy(op.get("value")), path)
        elif kind in ("move", "copy"):
            source_parts = _pointer(op.get("from", ""))
            value = copy.deepcopy(_resolve(doc, source_parts, op.get("from", "")))
            if kind == "move":
                doc = _remove(doc, source_parts, op.get("from", ""))
            doc = _add(doc, parts, value, path)
        else:
            raise PatchError(f"unknown JSON patch operation {kind!r}", status=400)
    return doc
