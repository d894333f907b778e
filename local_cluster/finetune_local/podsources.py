"""What a pod draws from the API before its container starts: the ConfigMaps and Secrets its
environment refers to, and its PersistentVolumeClaims, bound on first use."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

from finetune_local.restclient import ApiStatusError, RestClient, resource_path


def referenced_configs(container: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(kind, name) of each ConfigMap ("configMap") and Secret ("secret") the container's
    env and envFrom read."""
    refs: list[tuple[str, str]] = []
    for item in container.get("env") or []:
        source = item.get("valueFrom") or {}
        for kind in ("configMap", "secret"):
            if f"{kind}KeyRef" in source:
                refs.append((kind, source[f"{kind}KeyRef"].get("name", "")))
    for source in container.get("envFrom") or []:
        for kind in ("configMap", "secret"):
            if f"{kind}Ref" in source:
                refs.append((kind, source[f"{kind}Ref"].get("name", "")))
    return refs


async def fetch_config(
    client: RestClient, kind: str, namespace: str, name: str
) -> dict[str, Any] | None:
    """The ConfigMap (`kind` "configMap") or Secret (else); None when it does not exist."""
    plural = "configmaps" if kind == "configMap" else "secrets"
    try:
        result: dict[str, Any] = await client.get(resource_path("v1", plural, namespace, name))
        return result
    except ApiStatusError as exc:
        if exc.status == 404:
            return None
        raise


async def bind_claim(
    client: RestClient, data_dir: pathlib.Path, namespace: str, name: str
) -> pathlib.Path | None:
    """Provision and bind a PersistentVolumeClaim on its first consumer, as a
    WaitForFirstConsumer storage class does: a host directory per claim, kept when pods
    go (the claim outlives them). None when the claim does not exist."""
    path = resource_path("v1", "persistentvolumeclaims", namespace, name)
    try:
        claim: dict[str, Any] = await client.get(path)
    except ApiStatusError as exc:
        if exc.status == 404:
            return None
        raise
    directory = data_dir / "pvcs" / namespace / name
    directory.mkdir(parents=True, exist_ok=True)
    if claim.get("status", {}).get("phase") != "Bound":
        spec = claim.get("spec", {})
        status = {
            "phase": "Bound",
            "accessModes": spec.get("accessModes", ["ReadWriteOnce"]),
            "capacity": dict(spec.get("resources", {}).get("requests", {})),
        }
        status_path = resource_path("v1", "persistentvolumeclaims", namespace, name, "status")
        await client.merge_patch(status_path, {"status": status})
    return directory
