"""Server-side printing: ``Accept: application/json;as=Table;g=meta.k8s.io;v=v1``.

``kubectl get`` asks for a Table and prints its cells as they come, so the columns a user sees
(the CRD's ``additionalPrinterColumns``, or a pod's READY/STATUS/RESTARTS) are decided here.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

from finetune_local.apiresources import ResourceType

_SEGMENT = re.compile(
    r"\.([A-Za-z0-9_\-]+)|\[(\d+)\]|\[\?\(@\.([A-Za-z0-9_.]+)\s*==\s*['\"]([^'\"]*)['\"]\)\]"
)


def wants_table(accept: str) -> bool:
    # The first acceptable media type wins; kubectl lists Table first with JSON as fallback.
    first = accept.split(",")[0]
    return "as=Table" in first


def jsonpath(obj: Any, expression: str) -> Any:
    """The subset of JSONPath used by printer columns: fields, indexes, ``[?(@.k=="v")]``."""
    expression = expression.strip().removeprefix("{").removesuffix("}").removeprefix("$")
    current = [obj]
    for match in _SEGMENT.finditer(expression):
        name, index, filter_key, filter_value = match.groups()
        found: list[Any] = []
        for item in current:
            if name is not None and isinstance(item, dict) and name in item:
                found.append(item[name])
            elif index is not None and isinstance(item, list) and int(index) < len(item):
                found.append(item[int(index)])
            elif filter_key is not None and isinstance(item, list):
                found.extend(x for x in item if _dig(x, filter_key) == filter_value)
        current = found
    if not current:
        return None
    return current[0] if len(current) == 1 else current


def _dig(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def human_age(timestamp: str | None, now: datetime.datetime) -> str:
    """As Kubernetes' ``duration.HumanDuration``: 45s, 3m20s, 5h, 2d."""
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = max(0, int((now - then).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    return f"{hours}h" if hours < 48 else f"{hours // 24}d"


def _column(name: str, kind: str = "string", priority: int = 0, fmt: str = "") -> dict[str, Any]:
    return {"name": name, "type": kind, "format": fmt, "description": "", "priority": priority}


def _pod_cells(pod: dict[str, Any], age: str) -> list[Any]:
    status = pod.get("status", {})
    statuses = status.get("containerStatuses", [])
    containers = pod.get("spec", {}).get("containers", [])
    ready = sum(1 for s in statuses if s.get("ready"))
    reason = status.get("reason") or status.get("phase", "Pending")
    for cs in statuses:
        state = cs.get("state", {})
        if "terminated" in state:
            reason = state["terminated"].get("reason") or reason
        elif state.get("waiting", {}).get("reason"):
            reason = state["waiting"]["reason"]
    if pod.get("metadata", {}).get("deletionTimestamp"):
        reason = "Terminating"
    restarts = sum(int(s.get("restartCount", 0)) for s in statuses)
    return [
        pod["metadata"].get("name"),
        f"{ready}/{len(containers)}",
        reason,
        restarts,
        age,
        status.get("podIP", "<none>"),
        pod.get("spec", {}).get("nodeName", "<none>"),
    ]


_EVENT_COLUMNS = [
    _column("Last Seen"),
    _column("Type"),
    _column("Reason"),
    _column("Object"),
    _column("Subobject", priority=1),
    _column("Source", priority=1),
    _column("Message"),
    _column("First Seen", priority=1),
    _column("Count", "integer", priority=1),
    _column("Name", fmt="name", priority=1),
]


def _event_cells(event: dict[str, Any], now: datetime.datetime) -> list[Any]:
    """A core/v1 Event's row as the API server prints it (`kubectl get events`): the object
    as kind/name, times from the series where the recorder aggregated repeats."""
    meta = event.get("metadata", {})
    series = event.get("series") or {}
    involved = event.get("involvedObject", {})
    last = series.get("lastObservedTime") or event.get("lastTimestamp") or event.get("eventTime")
    first = event.get("firstTimestamp") or event.get("eventTime")
    source = event.get("source", {})
    where = ", ".join(x for x in (source.get("component"), source.get("host")) if x)
    return [
        human_age(last or meta.get("creationTimestamp"), now),
        event.get("type", ""),
        event.get("reason", ""),
        f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}",
        involved.get("fieldPath", ""),
        where,
        event.get("message", ""),
        human_age(first or meta.get("creationTimestamp"), now),
        series.get("count") or event.get("count") or 1,
        meta.get("name"),
    ]


def _columns_and_cells(
    rtype: ResourceType,
    obj: dict[str, Any],
    now: datetime.datetime,
) -> tuple[list[dict[str, Any]], list[Any]]:
    meta = obj.get("metadata", {})
    age = human_age(meta.get("creationTimestamp"), now)
    if rtype.printer_columns:
        columns = [_column("Name", fmt="name")]
        cells: list[Any] = [meta.get("name")]
        for col in rtype.printer_columns:
            columns.append(
                _column(
                    col["name"],
                    col.get("type", "string"),
                    col.get("priority", 0),
                    col.get("format", ""),
                )
            )
            value = jsonpath(obj, col["jsonPath"])
            if col.get("type") == "date" and isinstance(value, str):
                value = human_age(value, now)
            cells.append(value)
        return columns, cells
    if rtype.kind == "Pod" and not rtype.group:
        columns = [
            _column("Name", fmt="name"),
            _column("Ready"),
            _column("Status"),
            _column("Restarts", "integer"),
            _column("Age"),
            _column("IP", priority=1),
            _column("Node", priority=1),
        ]
        return columns, _pod_cells(obj, age)
    if rtype.kind == "Event" and not rtype.group:
        return _EVENT_COLUMNS, _event_cells(obj, now)
    if rtype.kind == "Node" and not rtype.group:
        conditions = obj.get("status", {}).get("conditions", [])
        ready: dict[str, Any] = next((c for c in conditions if c.get("type") == "Ready"), {})
        state = "Ready" if ready.get("status") == "True" else "NotReady"
        if obj.get("spec", {}).get("unschedulable"):
            state += ",SchedulingDisabled"
        return (
            [_column("Name", fmt="name"), _column("Status"), _column("Age")],
            [meta.get("name"), state, age],
        )
    return [_column("Name", fmt="name"), _column("Age")], [meta.get("name"), age]


def to_table(
    rtype: ResourceType,
    objects: list[dict[str, Any]],
    resource_version: str,
    include_object: str,
    now: datetime.datetime,
) -> dict[str, Any]:
    columns: list[dict[str, Any]] = _columns_and_cells(rtype, {"metadata": {}}, now)[0]
    rows = []
    for obj in objects:
        columns, cells = _columns_and_cells(rtype, obj, now)
        if include_object == "None":
            embedded: dict[str, Any] | None = None
        elif include_object == "Object":
            embedded = obj
        else:  # Metadata is the default: PartialObjectMetadata, as kubectl expects
            embedded = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj.get("metadata", {}),
            }
        rows.append({"cells": cells, "object": embedded})
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": columns,
        "rows": rows,
    }
