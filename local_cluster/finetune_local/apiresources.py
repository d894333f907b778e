"""What the emulated API server serves: built-in resource types, CRD-backed types, discovery.

A :class:`ResourceType` is everything the server needs to know about one group/version/plural:
its kind, scope, short names, whether writes to ``status`` go only through ``/status``, and for
custom resources the validation schema and the printer columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from finetune_operator.api.schema_validation import CustomResourceSchema

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status_subresource: bool = False
    extra_subresources: tuple[str, ...] = ()
    schema: CustomResourceSchema | None = None
    printer_columns: list[dict[str, Any]] = field(default_factory=list)
    crd_name: str | None = None  # set for custom resources

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.version, self.plural)

    def discovery_entries(self) -> list[dict[str, Any]]:
        main = {
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": list(ALL_VERBS),
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if self.categories:
            main["categories"] = list(self.categories)
        entries = [main]
        subresources = (("status",) if self.status_subresource else ()) + self.extra_subresources
        for sub in subresources:
            verbs = ["get"] if sub == "log" else ["get", "patch", "update"]
            entries.append(
                {
                    "name": f"{self.plural}/{sub}",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "kind": self.kind,
                    "verbs": verbs,
                }
            )
        return entries


def _core(plural: str, kind: str, namespaced: bool = True, **kwargs: Any) -> ResourceType:
    return ResourceType("", "v1", plural, kind, namespaced, **kwargs)


BUILTIN_TYPES: tuple[ResourceType, ...] = (
    _core("namespaces", "Namespace", False, short_names=("ns",), status_subresource=True),
    _core(
        "pods",
        "Pod",
        short_names=("po",),
        categories=("all",),
        status_subresource=True,
        extra_subresources=("log",),
    ),
    _core(
        "services", "Service", short_names=("svc",), categories=("all",), status_subresource=True
    ),
    _core("endpoints", "Endpoints", short_names=("ep",)),
    _core("configmaps", "ConfigMap", short_names=("cm",)),
    _core("secrets", "Secret"),
    _core("serviceaccounts", "ServiceAccount", short_names=("sa",)),
    _core(
        "persistentvolumeclaims",
        "PersistentVolumeClaim",
        short_names=("pvc",),
        status_subresource=True,
    ),
    _core("events", "Event", short_names=("ev",)),
    _core("nodes", "Node", False, short_names=("no",), status_subresource=True),
    ResourceType("events.k8s.io", "v1", "events", "Event", True, short_names=("ev",)),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True),
    # Stored, not enforced (as on a cluster whose network plugin ignores NetworkPolicy).
    ResourceType(
        "networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True, short_names=("netpol",)
    ),
    ResourceType(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        short_names=("crd", "crds"),
        status_subresource=True,
    ),
)


def types_from_crd(crd: dict[str, Any]) -> list[ResourceType]:
    """The served versions of a CRD as resource types (one per served version)."""
    spec = crd.get("spec", {})
    names = spec.get("names", {})
    result = []
    for version in spec.get("versions", []):
        if not version.get("served", True):
            continue
        raw_schema = (version.get("schema") or {}).get("openAPIV3Schema")
        result.append(
            ResourceType(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=tuple(names.get("shortNames", [])),
                categories=tuple(names.get("categories", [])),
                status_subresource="status" in (version.get("subresources") or {}),
                schema=CustomResourceSchema(raw_schema) if raw_schema else None,
                printer_columns=list(version.get("additionalPrinterColumns", [])),
                crd_name=crd["metadata"]["name"],
            )
        )
    return result


class Registry:
    """The resource types currently served, by (group, version, plural)."""

    def __init__(self) -> None:
        self._types: dict[tuple[str, str, str], ResourceType] = {t.key: t for t in BUILTIN_TYPES}

    def get(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self._types.get((group, version, plural))

    def all(self) -> list[ResourceType]:
        return list(self._types.values())

    def register_crd(self, crd: dict[str, Any]) -> list[ResourceType]:
        self.unregister_crd(crd["metadata"]["name"])
        added = types_from_crd(crd)
        for rtype in added:
            self._types[rtype.key] = rtype
        return added

    def unregister_crd(self, crd_name: str) -> list[ResourceType]:
        gone = [t for t in self._types.values() if t.crd_name == crd_name]
        for rtype in gone:
            del self._types[rtype.key]
        return gone

    # ---- discovery documents ----

    def groups(self) -> dict[str, list[str]]:
        result: dict[str, list[str]] = {}
        for rtype in self._types.values():
            if rtype.group and rtype.version not in result.setdefault(rtype.group, []):
                result[rtype.group].append(rtype.version)
        return result

    def api_group(self, group: str) -> dict[str, Any] | None:
        versions = self.groups().get(group)
        if not versions:
            return None
        listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": group,
            "versions": listed,
            "preferredVersion": listed[0],
        }

    def api_group_list(self) -> dict[str, Any]:
        groups = [self.api_group(g) for g in sorted(self.groups())]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [g for g in groups if g]}

    def api_resource_list(self, group: str, version: str) -> dict[str, Any] | None:
        types = [t for t in self._types.values() if (t.group, t.version) == (group, version)]
        if not types:
            return None
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": [entry for t in types for entry in t.discovery_entries()],
        }

    # ---- OpenAPI v3: what kubectl needs for server-side field validation and `explain` ----

    def openapi_index(self) -> dict[str, Any]:
        versions = {(t.group, t.version) for t in self._types.values()}
        paths = {}
        for group, version in sorted(versions):
            key = f"apis/{group}/{version}" if group else f"api/{version}"
            paths[key] = {"serverRelativeURL": f"/openapi/v3/{key}"}
        return {"paths": paths}

    def openapi_document(self, group: str, version: str) -> dict[str, Any] | None:
        """PATCH operations tagged with their GVK and a ``fieldValidation`` query parameter:
        kubectl checks exactly that before sending ``fieldValidation=Strict`` instead of
        validating client-side against OpenAPI v2 (which is not served). Custom resources'
        schemas too, as the API server publishes a CRD's: ``kubectl explain`` finds a kind's
        by its GVK (built-in kinds have none here)."""
        types = [t for t in self._types.values() if (t.group, t.version) == (group, version)]
        if not types:
            return None
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        param = {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}
        paths = {}
        for rtype in types:
            scope = "/namespaces/{namespace}" if rtype.namespaced else ""
            gvk = {"group": group, "version": version, "kind": rtype.kind}
            paths[f"{prefix}{scope}/{rtype.plural}/{{name}}"] = {
                "patch": {
                    "x-kubernetes-group-version-kind": gvk,
                    "parameters": [param],
                    "responses": {"200": {"description": "OK"}},
                }
            }
        return {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": "v1.32.0"},
            "paths": paths,
            "components": {
                "schemas": dict(
                    _crd_schema(t, t.schema.schema) for t in types if t.schema is not None
                )
            },
        }


_OBJECT_FIELDS = {
    "apiVersion": {
        "type": "string",
        "description": "APIVersion defines the versioned schema of this representation of an object.",
    },
    "kind": {
        "type": "string",
        "description": "Kind is a string value representing the REST resource this object represents.",
    },
    "metadata": {"type": "object", "description": "Standard object's metadata."},
}


def _crd_schema(rtype: ResourceType, crd_schema: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A custom resource's schema under the name the API server gives it
    (``dev.finetune.v1alpha1.FineTuneJob``), the fields every object has described as it
    describes them (over the CRD's own, which only declare their type)."""
    schema = dict(crd_schema)
    schema["properties"] = {**schema.get("properties", {}), **_OBJECT_FIELDS}
    gvk = {"group": rtype.group, "version": rtype.version, "kind": rtype.kind}
    schema["x-kubernetes-group-version-kind"] = [gvk]
    name = ".".join([*reversed(rtype.group.split(".")), rtype.version, rtype.kind])
    return name, schema
