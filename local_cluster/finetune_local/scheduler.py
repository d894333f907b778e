"""Pod placement onto virtual nodes: a pure function, like a scheduler's filter + score phases.

Filters: ``spec.nodeName`` (already bound), node ``unschedulable``, ``nodeSelector``, required
node affinity (``In``, ``NotIn``, ``Exists``, ``DoesNotExist``, ``Gt``, ``Lt`` on labels;
``matchFields`` on ``metadata.name``) and extended resources (e.g. ``nvidia.com/gpu``) against the
node's allocatable minus what its pods request. Score: the node with the fewest pods, then name.
Taints, inter-pod affinity and cpu/memory fit are not modelled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_BASIC = ("cpu", "memory", "ephemeral-storage", "pods")


def quantity(value: Any) -> float:
    """A Kubernetes quantity (`500m`, `2Gi`, `1k`) as a number."""
    text = str(value)
    suffixes = {
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "P": 1e15,
        "E": 1e18,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "Pi": 2**50,
        "Ei": 2**60,
    }
    for suffix, factor in sorted(suffixes.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def pods_by_node(pods: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """The bound pods that still hold their node's resources (not Succeeded or Failed)."""
    placed: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        node = pod.get("spec", {}).get("nodeName")
        if node and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
            placed.setdefault(node, []).append(pod)
    return placed


def _expression_matches(expr: Mapping[str, Any], values: Mapping[str, str]) -> bool:
    key, op, wanted = expr.get("key", ""), expr.get("operator", "In"), expr.get("values") or []
    present = key in values
    if op == "In":
        return present and values[key] in wanted
    if op == "NotIn":
        return not present or values[key] not in wanted
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt") and present and wanted:
        try:
            actual, bound = int(values[key]), int(wanted[0])
        except ValueError:
            return False
        return actual > bound if op == "Gt" else actual < bound
    return False


def _term_matches(term: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    labels = node.get("metadata", {}).get("labels") or {}
    fields = {"metadata.name": node.get("metadata", {}).get("name", "")}
    exprs = term.get("matchExpressions") or []
    field_exprs = term.get("matchFields") or []
    if not exprs and not field_exprs:
        return False  # an empty term matches nothing, as in Kubernetes
    return all(_expression_matches(e, labels) for e in exprs) and all(
        _expression_matches(e, fields) for e in field_exprs
    )


def _extended_requests(pod: Mapping[str, Any]) -> dict[str, float]:
    total: dict[str, float] = {}
    for container in pod.get("spec", {}).get("containers", []):
        resources = container.get("resources") or {}
        requests = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, value in requests.items():
            if name not in _BASIC:
                total[name] = total.get(name, 0.0) + quantity(value)
    return total


def unfit_reason(
    pod: Mapping[str, Any], node: Mapping[str, Any], pods_on_node: list[Mapping[str, Any]]
) -> str | None:
    """Why ``pod`` cannot run on ``node`` (None if it can)."""
    spec = pod.get("spec", {})
    labels = node.get("metadata", {}).get("labels") or {}
    if node.get("spec", {}).get("unschedulable"):
        return "node(s) were unschedulable"
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return "node(s) didn't match Pod's node affinity/selector"
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms")
    if terms and not any(_term_matches(t, node) for t in terms):
        return "node(s) didn't match Pod's node affinity/selector"
    allocatable = node.get("status", {}).get("allocatable") or {}
    if "pods" in allocatable and len(pods_on_node) >= quantity(allocatable["pods"]):
        return "Too many pods"
    used: dict[str, float] = {}
    for other in pods_on_node:
        for name, amount in _extended_requests(other).items():
            used[name] = used.get(name, 0.0) + amount
    for name, amount in _extended_requests(pod).items():
        if used.get(name, 0.0) + amount > quantity(allocatable.get(name, 0)):
            return f"Insufficient {name}"
    return None


def pick_node(
    pod: Mapping[str, Any],
    nodes: list[Mapping[str, Any]],
    pods_by_node: Mapping[str, list[Mapping[str, Any]]],
) -> tuple[str | None, str]:
    """The chosen node name, or None with a FailedScheduling-style message."""
    reasons: dict[str, int] = {}
    fitting: list[tuple[int, str]] = []
    for node in nodes:
        name = node["metadata"]["name"]
        placed = pods_by_node.get(name, [])
        reason = unfit_reason(pod, node, placed)
        if reason is None:
            fitting.append((len(placed), name))
        else:
            reasons[reason] = reasons.get(reason, 0) + 1
    if fitting:
        return min(fitting)[1], ""
    details = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
    return None, f"0/{len(nodes)} nodes are available: {details}."


def place_gang(
    pending: Sequence[Mapping[str, Any]],
    bound: int,
    min_member: int,
    nodes: list[Mapping[str, Any]],
    pods_by_node: Mapping[str, list[Mapping[str, Any]]],
) -> tuple[dict[str, str], str]:
    """All-or-nothing placement of a pod group (Coscheduling's Permit, Volcano's gang plugin):
    nodes for the group's ``pending`` pods, each placed as if the ones before it were bound,
    when with the ``bound`` members at least ``min_member`` run at once; else no node for any
    of them, and why. Members beyond the minimum that fit are placed too."""
    placed = {name: list(pods) for name, pods in pods_by_node.items()}
    chosen: dict[str, str] = {}
    why = ""
    for pod in pending:
        node, message = pick_node(pod, nodes, placed)
        if node is None:
            why = why or message
            continue
        chosen[pod["metadata"]["name"]] = node
        placed.setdefault(node, []).append(pod)
    if bound + len(chosen) >= min_member:
        return chosen, ""
    if bound + len(pending) < min_member:
        return {}, (
            f"the pod group has {bound + len(pending)} pods, fewer than its minMember {min_member}"
        )
    return {}, (
        f"{why} The pod group needs {min_member} pods at once and {bound + len(chosen)} "
        "fit: none is bound until all do."
    )
