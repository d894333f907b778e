"""kube-scheduler's NodeResourcesFit filter, as pure functions: what a pod requests, and which
resources a node lacks for it.

A pod's request, per resource, is the larger of what its containers run with together and what
its init containers need one at a time, plus its ``spec.overhead``:

- app containers and restartable init containers (sidecars, ``restartPolicy: Always``) are
  summed: they all run at once;
- a regular init container runs alone beside the sidecars started before it, so its need is
  its own request plus theirs; the pod needs the largest of those;
- ``spec.overhead`` (the RuntimeClass's cost of the sandbox) is added on top.

Only ``requests`` count: the API server gives a container with a limit but no request that
limit as its request at admission (:func:`finetune_local.podresources.default_requests`), as
Kubernetes does. cpu is counted in millicores, every other resource in whole units (bytes for
memory and ephemeral-storage), each rounded up as Kubernetes rounds a quantity.

A node fits when, for every resource the pod requests (more than zero of),
its ``status.allocatable`` is at least what its pods that still hold resources (bound and not
Succeeded or Failed) request plus this pod's request; and it has room for one more pod under
``allocatable.pods``. A pod that requests nothing needs only the pod slot. A resource the node
does not advertise counts as zero allocatable, ``pods`` included: a pod asking for it fits
nowhere, and a node with no ``allocatable.pods`` takes no pod. All the
shortfalls of a node are reported (``Insufficient cpu``, ``Too many pods``...), as the
scheduler counts each in its FailedScheduling message.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from finetune_operator.api.quantity import UNITS

# The operator's byte suffixes (binary and decimal), with the sub-unit ones a cpu takes.
_SUFFIXES = {
    **{suffix: Decimal(factor) for suffix, factor in UNITS.items() if suffix},
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
}
# Longest first ("Mi" before "M"), sorted once: every scheduling pass parses every request.
_BY_LENGTH = sorted(_SUFFIXES, key=len, reverse=True)

Requests = dict[str, int]


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes quantity (``500m``, ``2Gi``, ``1.5``, ``1e3``) as an exact number."""
    text = str(value).strip()
    for suffix in _BY_LENGTH:
        if text.endswith(suffix):
            number, factor = text[: -len(suffix)], _SUFFIXES[suffix]
            break
    else:
        number, factor = text, Decimal(1)
    try:
        parsed = Decimal(number) * factor
    except InvalidOperation:
        parsed = Decimal("NaN")
    if not parsed.is_finite():
        raise ValueError(f"quantity {value!r} is not a Kubernetes quantity")
    return parsed


def amount(resource: str, value: Any) -> int:
    """``value`` of ``resource`` in the scheduler's unit: millicores for cpu, else whole units,
    rounded up (``0.1m`` of cpu is 1m, as Kubernetes rounds)."""
    scale = 1000 if resource == "cpu" else 1
    return math.ceil(parse_quantity(value) * scale)


def _requests_of(container: Mapping[str, Any]) -> Requests:
    requested = (container.get("resources") or {}).get("requests") or {}
    return {name: amount(name, value) for name, value in requested.items()}


def _add(total: Requests, more: Mapping[str, int]) -> Requests:
    out = dict(total)
    for name, value in more.items():
        out[name] = out.get(name, 0) + value
    return out


def _maximum(one: Mapping[str, int], other: Mapping[str, int]) -> Requests:
    return {name: max(one.get(name, 0), other.get(name, 0)) for name in {*one, *other}}


def pod_requests(pod: Mapping[str, Any]) -> Requests:
    """What ``pod`` requests of each resource (the module docstring says how)."""
    spec = pod.get("spec") or {}
    running: Requests = {}
    for container in spec.get("containers") or []:
        running = _add(running, _requests_of(container))
    sidecars: Requests = {}
    init_peak: Requests = {}
    for container in spec.get("initContainers") or []:
        own = _requests_of(container)
        if container.get("restartPolicy") == "Always":
            sidecars = _add(sidecars, own)
            init_peak = _maximum(init_peak, sidecars)
        else:
            init_peak = _maximum(init_peak, _add(own, sidecars))
    total = _maximum(_add(running, sidecars), init_peak)
    overhead = {name: amount(name, value) for name, value in (spec.get("overhead") or {}).items()}
    return {name: value for name, value in _add(total, overhead).items() if value}


def holds_resources(pod: Mapping[str, Any]) -> bool:
    """A bound pod keeps its node's resources until it ends (Succeeded or Failed); a pod being
    deleted still holds them while its containers stop."""
    return pod.get("status", {}).get("phase") not in ("Succeeded", "Failed")


def insufficient(
    pod: Mapping[str, Any],
    allocatable: Mapping[str, Any],
    pods_on_node: Iterable[Mapping[str, Any]],
) -> list[str]:
    """The node's shortfalls for ``pod`` in the scheduler's words (empty when it fits), in the
    scheduler's order: pods, cpu, memory, ephemeral-storage, then the other resources."""
    placed = [p for p in pods_on_node if holds_resources(p)]
    reasons: list[str] = []
    # A node that advertises no `pods` has room for none, as for any resource it does not list.
    if len(placed) + 1 > amount("pods", allocatable.get("pods", 0)):
        reasons.append("Too many pods")
    wanted = pod_requests(pod)
    wanted.pop("pods", None)
    if not wanted:
        return reasons
    used: Requests = {}
    for other in placed:
        used = _add(used, pod_requests(other))
    # Only what the pod requests is checked, as kube-scheduler's fitsRequest does (its
    # `podRequest.MilliCPU > 0 && ...`): a pod asking no cpu fits a node whose cpu is already
    # over-committed (pods bound by nodeName, an allocatable that shrank).
    basic = ("cpu", "memory", "ephemeral-storage")
    for name in [*basic, *sorted(r for r in wanted if r not in basic)]:
        free = amount(name, allocatable.get(name, 0)) - used.get(name, 0)
        if wanted.get(name, 0) > 0 and wanted[name] > free:
            reasons.append(f"Insufficient {name}")
    return reasons
