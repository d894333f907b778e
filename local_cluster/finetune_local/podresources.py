"""What the API server does to a pod's resource requests and limits on create: decode them,
default each missing request from its limit, validate them, and compute the pod's QoS class.

- Decoding: a value that is no quantity is a 400 naming its field.
- Defaulting: a container's limit with no request of the same resource becomes its request.
- Validation (a 422 with every cause, named by its field as the API server names it,
  ``spec.containers[0].resources.requests[cpu]``): no quantity below zero (overhead too); an
  extended resource (a name with a domain other than ``kubernetes.io``, such as
  ``nvidia.com/gpu``) in whole units, with a limit, and requested exactly at its limit (it
  cannot be overcommitted); a request of any other resource at most its limit.
- QoS class (``status.qosClass``), over init and app containers: only cpu and memory count,
  and only quantities above zero. BestEffort when no container requests or limits either;
  Guaranteed when every container limits both cpu and memory and the pod's requests equal its
  limits; else Burstable.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from finetune_local.apiresources import ResourceType
from finetune_local.apistore import bad_request, invalid
from finetune_local.resourcefit import parse_quantity

_QUANTITY_RULE = (
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
)
_QOS_RESOURCES = ("cpu", "memory")


def _containers(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each container with its field path, init containers first (the API server's order)."""
    return [
        (f"spec.{kind}[{i}]", container)
        for kind in ("initContainers", "containers")
        for i, container in enumerate(spec.get(kind) or [])
    ]


def _check_quantities(spec: dict[str, Any]) -> None:
    """A request, limit or overhead that is no quantity is refused (400), as the API server's
    decoding refuses it; named by its field here."""
    fields = [("spec.overhead", spec.get("overhead") or {})]
    for path, container in _containers(spec):
        resources = container.get("resources") or {}
        for which in ("requests", "limits"):
            fields.append((f"{path}.resources.{which}", resources.get(which) or {}))
    for field, values in fields:
        for name, value in values.items():
            try:
                parse_quantity(value)
            except ValueError:
                raise bad_request(f"{field}[{name}]: {value!r}: {_QUANTITY_RULE}") from None


def default_requests(spec: dict[str, Any]) -> None:
    """A container's limit with no request of the same resource becomes its request, as the
    API server's defaulting does: the scheduler then reserves what the container may use."""
    _check_quantities(spec)
    for _, container in _containers(spec):
        resources = container.get("resources") or {}
        limits = resources.get("limits") or {}
        if limits:
            requests = resources.setdefault("requests", {})
            for name, value in limits.items():
                requests.setdefault(name, value)
            container["resources"] = resources


def _extended(name: str) -> bool:
    """An extended resource (``nvidia.com/gpu``): a domain-prefixed name outside kubernetes.io;
    hugepages are native but may not be overcommitted either."""
    domain = name.split("/", 1)[0] if "/" in name else ""
    native = not domain or domain == "kubernetes.io" or domain.endswith(".kubernetes.io")
    return not native


def _no_overcommit(name: str) -> bool:
    return _extended(name) or name.startswith("hugepages-")


def _shown(value: Any) -> str:
    return str(value).strip()


def _value_errors(field: str, name: str, value: Any) -> list[tuple[str, str]]:
    quantity = parse_quantity(value)
    if quantity < 0:
        return [(field, f'Invalid value: "{_shown(value)}": must be greater than or equal to 0')]
    if _extended(name) and quantity != quantity.to_integral_value():
        return [(field, f'Invalid value: "{_shown(value)}": must be an integer')]
    return []


def resource_errors(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """What the API server's validation says of the pod's requests and limits (after
    defaulting): (field, message) per fault, empty when they are valid."""
    errors: list[tuple[str, str]] = []
    for name, value in (spec.get("overhead") or {}).items():
        errors += _value_errors(f"spec.overhead[{name}]", name, value)
    for path, container in _containers(spec):
        resources = container.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        for name, value in limits.items():
            errors += _value_errors(f"{path}.resources.limits[{name}]", name, value)
        for name, value in requests.items():
            field = f"{path}.resources.requests[{name}]"
            found = _value_errors(field, name, value)
            errors += found
            if found:
                continue
            if name not in limits:
                if _no_overcommit(name):
                    errors.append(
                        (
                            f"{path}.resources.limits",
                            "Required value: Limit must be set for non overcommitable resources",
                        )
                    )
                continue
            request, limit = parse_quantity(value), parse_quantity(limits[name])
            if _no_overcommit(name) and request != limit:
                errors.append(
                    (
                        field,
                        f'Invalid value: "{_shown(value)}": must be equal to {name} limit of '
                        f"{_shown(limits[name])}",
                    )
                )
            elif request > limit:
                errors.append(
                    (
                        field,
                        f'Invalid value: "{_shown(value)}": must be less than or equal to '
                        f"{name} limit of {_shown(limits[name])}",
                    )
                )
    return errors


def validate_resources(rtype: ResourceType, name: str, spec: dict[str, Any]) -> None:
    """Refuse (422) a pod whose requests or limits the API server's validation refuses."""
    errors = resource_errors(spec)
    if errors:
        raise invalid(rtype, name, errors)


def qos_class(spec: dict[str, Any]) -> str:
    """The pod's QoS class (the module docstring says how), as the API server computes it."""
    requests: dict[str, Decimal] = {}
    limits: dict[str, Decimal] = {}
    guaranteed = True
    for _, container in _containers(spec):
        resources = container.get("resources") or {}
        for which, total in (
            (resources.get("requests"), requests),
            (resources.get("limits"), limits),
        ):
            for name, value in (which or {}).items():
                quantity = parse_quantity(value)
                if name in _QOS_RESOURCES and quantity > 0:
                    total[name] = total.get(name, Decimal(0)) + quantity
        limited = {
            name
            for name, value in (resources.get("limits") or {}).items()
            if name in _QOS_RESOURCES and parse_quantity(value) > 0
        }
        if not limited.issuperset(_QOS_RESOURCES):
            guaranteed = False
    if not requests and not limits:
        return "BestEffort"
    if guaranteed and requests == limits:
        return "Guaranteed"
    return "Burstable"
