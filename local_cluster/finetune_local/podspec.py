"""Pure translations of a pod spec into what the local kubelet needs to start it.

- the container environment: ``env`` with ``$(VAR)`` expansion (earlier entries only, ``$$``
  escapes, unresolved references kept verbatim, as Kubernetes does), the downward API
  (``fieldRef``) and ``configMapKeyRef``/``secretKeyRef``/``envFrom``;
- the ``/etc/hosts`` file of a pod, which stands in for cluster DNS (see :func:`render_hosts`).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from finetune_local.selectors import labels_match, selector_from_match_labels

ConfigLookup = Callable[[str, str], "Mapping[str, str] | None"]  # (kind, name) -> data
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")
_LABEL_FIELD = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


class ConfigMissingError(Exception):
    """A referenced ConfigMap/Secret (or key) is absent: the kubelet retries, as a real one does."""


class ContainerConfigError(ConfigMissingError):
    """The container's environment names a ConfigMap/Secret or key that is absent: a real
    kubelet leaves the container waiting with reason CreateContainerConfigError (the pod stays
    Pending) and tries again, with the same messages as here."""


_KIND_NAMES = {"configMap": ("configmap", "ConfigMap"), "secret": ("secret", "Secret")}


def expand(value: str, env: Mapping[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _REF.sub(replace, value)


def field_ref(pod: Mapping[str, Any], path: str) -> str:
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    if match := _LABEL_FIELD.match(path):
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    values = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": status.get("podIP"),
        "status.podIPs": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.hostIPs": status.get("hostIP"),
    }
    if path not in values:
        raise ValueError(f"unsupported fieldRef {path!r}")
    return str(values[path] or "")


def _key_ref(ref: Mapping[str, Any], kind: str, lookup: ConfigLookup, namespace: str) -> str | None:
    name = ref.get("name", "")
    data = lookup(kind, name)
    if data is None or ref.get("key") not in data:
        if ref.get("optional"):
            return None
        lower, title = _KIND_NAMES[kind]
        if data is None:
            raise ContainerConfigError(f'{lower} "{name}" not found')
        raise ContainerConfigError(
            f"couldn't find key {ref.get('key')} in {title} {namespace}/{name}"
        )
    return data[ref["key"]]


def container_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    lookup: ConfigLookup,
    base: Mapping[str, str],
) -> dict[str, str]:
    """The process environment: ``base`` (PATH etc.), then envFrom, then env, in order."""
    env: dict[str, str] = dict(base)
    declared: dict[str, str] = {}
    namespace = str(pod.get("metadata", {}).get("namespace") or "default")
    for source in container.get("envFrom") or []:
        for kind in ("configMap", "secret"):
            ref = source.get(f"{kind}Ref")
            if ref is None:
                continue
            data = lookup(kind, ref.get("name", ""))
            if data is None and not ref.get("optional"):
                raise ContainerConfigError(f'{_KIND_NAMES[kind][0]} "{ref.get("name")}" not found')
            for key, value in (data or {}).items():
                declared[source.get("prefix", "") + key] = value
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item:
            declared[name] = expand(str(item["value"]), declared)
            continue
        source = item.get("valueFrom") or {}
        resolved: str | None = ""
        if "fieldRef" in source:
            resolved = field_ref(pod, source["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in source:
            resolved = _key_ref(source["configMapKeyRef"], "configMap", lookup, namespace)
        elif "secretKeyRef" in source:
            resolved = _key_ref(source["secretKeyRef"], "secret", lookup, namespace)
        if resolved is not None:
            declared[name] = resolved
    env.update(declared)
    return env


def secret_data(secret: Mapping[str, Any]) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    data.update(secret.get("stringData") or {})
    return data


def endpoint_ips(service: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """IPs of the running pods a Service selects (its endpoints, without a kube-proxy)."""
    selector = service.get("spec", {}).get("selector")
    if not selector:
        return []
    requirements = selector_from_match_labels(selector)
    namespace = service["metadata"].get("namespace")
    return sorted(
        p["status"]["podIP"]
        for p in pods
        if p["metadata"].get("namespace") == namespace
        and labels_match(requirements, p)
        and p.get("status", {}).get("podIP")
        and p.get("status", {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
    )


def render_hosts(
    pod: Mapping[str, Any],
    pod_ip: str,
    services: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    domain: str = "cluster.local",
) -> str:
    """The pod's /etc/hosts, standing in for cluster DNS.

    Every Service resolves as ``<svc>`` (same namespace only, like the DNS search path),
    ``<svc>.<ns>``, ``<svc>.<ns>.svc`` and ``<svc>.<ns>.svc.<domain>`` to its endpoint pod IPs
    (there is no kube-proxy, so ClusterIP services also resolve to pod IPs), and pods with
    ``hostname``/``subdomain`` under a headless service get their
    ``<hostname>.<subdomain>.<ns>.svc.<domain>`` records, as in Kubernetes DNS.
    """
    meta, spec = pod["metadata"], pod.get("spec", {})
    namespace = meta.get("namespace", "default")
    hostname = spec.get("hostname") or meta["name"]
    own = hostname
    if spec.get("subdomain"):
        own = f"{hostname}.{spec['subdomain']}.{namespace}.svc.{domain} {hostname}"
    lines = [
        "# Kubernetes-managed hosts file (finetune-operator local kubelet).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        f"{pod_ip}\t{own}",
        "# services",
    ]
    for service in sorted(
        services, key=lambda s: (s["metadata"].get("namespace", ""), s["metadata"]["name"])
    ):
        name, ns = service["metadata"]["name"], service["metadata"].get("namespace", "default")
        names = [f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.{domain}"]
        if ns == namespace:
            names.insert(0, name)
        for ip in endpoint_ips(service, list(pods)):
            lines.append(f"{ip}\t{' '.join(names)}")
        if service.get("spec", {}).get("clusterIP") == "None":
            for member in pods:
                mspec = member.get("spec", {})
                ip = member.get("status", {}).get("podIP")
                if (
                    mspec.get("subdomain") == name
                    and member["metadata"].get("namespace") == ns
                    and ip
                    and member is not pod
                    and member["metadata"]["name"] != meta["name"]
                ):
                    host = mspec.get("hostname") or member["metadata"]["name"]
                    lines.append(f"{ip}\t{host}.{name}.{ns}.svc.{domain} {host}.{name}.{ns}.svc")
    return "\n".join(lines) + "\n"
