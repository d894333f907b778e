"""Merging the user's affinity with node anti-affinity to every excluded node."""

from __future__ import annotations

import copy
from typing import Any

HOSTNAME_LABEL = "kubernetes.io/hostname"


def merge_node_exclusion(
    user_affinity: dict[str, Any] | None, excluded: list[str]
) -> dict[str, Any]:
    """The user's affinity with `hostname NotIn excluded` required in every node selector term.

    Node selector terms are ORed, so the exclusion must be ANDed into each of them; appending a
    separate term would let a pod match the user's term and land on an excluded node anyway.
    """
    affinity = copy.deepcopy(user_affinity) if user_affinity else {}
    if not excluded:
        return affinity
    expression = {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": sorted(set(excluded))}
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {"nodeSelectorTerms": []}
    )
    terms: list[dict[str, Any]] = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        term.setdefault("matchExpressions", []).append(dict(expression))
    return affinity
