"""Pod placement onto virtual nodes: a pure function, like a scheduler's filter + score phases.

Filters, in kube-scheduler's order: ``spec.nodeName`` (already bound), node ``unschedulable``
(unless tolerated), taints (TaintToleration: a ``NoSchedule`` or ``NoExecute`` taint the pod's
``tolerations`` do not tolerate; ``PreferNoSchedule`` only scores), ``nodeSelector``, required
node affinity (``In``, ``NotIn``, ``Exists``, ``DoesNotExist``, ``Gt``, ``Lt`` on labels;
``matchFields`` on ``metadata.name``) and resource fit (NodeResourcesFit: cpu, memory,
ephemeral-storage, extended resources such as ``nvidia.com/gpu`` and the pod count, against the
node's allocatable minus what its pods request: :mod:`.resourcefit`). As in kube-scheduler, the
first filter a node fails gives its reasons (resource fit gives all its shortfalls at once), and
the FailedScheduling message counts the nodes per reason. Score: the node with the fewest pods,
then name. Inter-pod affinity, priorities and preemption are not modelled. Evicting pods
already bound to a node tainted ``NoExecute`` later is the taint eviction controller's
(:mod:`.tainteviction`), not the scheduler's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from finetune_local.resourcefit import holds_resources, insufficient


def pods_by_node(pods: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """The bound pods that still hold their node's resources (not Succeeded or Failed)."""
    placed: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        node = pod.get("spec", {}).get("nodeName")
        if node and holds_resources(pod):
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


_UNSCHEDULABLE_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """Whether ``toleration`` tolerates ``taint`` (the core API's rule): same effect, or none
    named; ``Exists`` with no key tolerates every key; ``Equal`` (the default) needs the value."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    if (toleration.get("operator") or "Equal") == "Exists":
        return True
    return (toleration.get("value") or "") == (taint.get("value") or "")


def untolerated_taint(pod: Mapping[str, Any], node: Mapping[str, Any]) -> str:
    """TaintToleration's reason for the node's first NoSchedule/NoExecute taint the pod does not
    tolerate (empty when none), in kube-scheduler's words."""
    tolerations = pod.get("spec", {}).get("tolerations") or []
    for taint in node.get("spec", {}).get("taints") or []:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if not any(tolerates(t, taint) for t in tolerations):
            return f"node(s) had untolerated taint {{{taint.get('key', '')}: {taint.get('value', '')}}}"
    return ""


def unfit_reasons(
    pod: Mapping[str, Any], node: Mapping[str, Any], pods_on_node: list[Mapping[str, Any]]
) -> list[str]:
    """Why ``pod`` cannot run on ``node`` (empty if it can)."""
    spec = pod.get("spec", {})
    labels = node.get("metadata", {}).get("labels") or {}
    tolerations = spec.get("tolerations") or []
    if node.get("spec", {}).get("unschedulable") and not any(
        tolerates(t, _UNSCHEDULABLE_TAINT) for t in tolerations
    ):
        return ["node(s) were unschedulable"]
    taint = untolerated_taint(pod, node)
    if taint:
        return [taint]
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return ["node(s) didn't match Pod's node affinity/selector"]
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms")
    if terms and not any(_term_matches(t, node) for t in terms):
        return ["node(s) didn't match Pod's node affinity/selector"]
    return insufficient(pod, node.get("status", {}).get("allocatable") or {}, pods_on_node)


def pick_node(
    pod: Mapping[str, Any],
    nodes: list[Mapping[str, Any]],
    pods_by_node: Mapping[str, list[Mapping[str, Any]]],
) -> tuple[str | None, str]:
    """The chosen node name, or None with the FailedScheduling message (:func:`fit_error`)."""
    reasons: dict[str, int] = {}
    fitting: list[tuple[int, str]] = []
    for node in nodes:
        name = node["metadata"]["name"]
        placed = pods_by_node.get(name, [])
        unfit = unfit_reasons(pod, node, placed)
        if not unfit:
            fitting.append((len(placed), name))
        for reason in unfit:
            reasons[reason] = reasons.get(reason, 0) + 1
    if fitting:
        return min(fitting)[1], ""
    return None, fit_error(len(nodes), reasons)


def fit_error(node_count: int, reasons: Mapping[str, int]) -> str:
    """kube-scheduler's FailedScheduling message: each reason with how many nodes gave it,
    sorted by reason (``0/3 nodes are available: 1 Insufficient cpu, 2 Insufficient
    memory.``). A node with several shortfalls counts under each. No node at all reads
    ``no nodes available to schedule pods``."""
    if node_count == 0:
        return "no nodes available to schedule pods"
    details = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
    return f"0/{node_count} nodes are available: {details}."


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
