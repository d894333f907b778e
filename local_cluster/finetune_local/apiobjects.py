"""The write semantics of the API server: what create, update, patch and delete do to objects.

Kept apart from HTTP so that it reads as the list of rules a real API server applies:
metadata (uid, creationTimestamp, generation, generateName), namespaces, the status
subresource, CRD schemas, finalizers, graceful pod deletion and garbage collection by
ownerReferences (background propagation).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import random
import re
import uuid
from collections.abc import Callable
from typing import Any

from finetune_local.apiresources import Registry, ResourceType
from finetune_local.apistore import (
    ApiError,
    Store,
    already_exists,
    bad_request,
    conflict,
    invalid,
    not_found,
)
from finetune_local.patches import (
    PatchError,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # what the apiserver's generateName uses
_SERVER_OWNED = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
)
Clock = Callable[[], datetime.datetime]


def timestamp(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec_part(obj: dict[str, Any], rtype: ResourceType) -> dict[str, Any]:
    """What ``generation`` tracks: all but metadata (and status, where it is a subresource)."""
    skip = ("metadata", "status") if rtype.status_subresource else ("metadata",)
    return {k: v for k, v in obj.items() if k not in skip}


def _check_object_meta(obj: dict[str, Any]) -> None:
    """A real server decodes metadata into the typed ObjectMeta: a wrong type is a 400, not
    something to store (or to crash on)."""
    meta = obj.get("metadata", {})
    if not isinstance(meta, dict):
        raise bad_request(
            "Object 'metadata' must be an object: cannot unmarshal "
            f"{type(meta).__name__} into Go struct field .metadata of type v1.ObjectMeta"
        )
    for key in ("name", "namespace", "generateName", "resourceVersion", "uid"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise bad_request(
                f"metadata.{key}: cannot unmarshal {type(meta[key]).__name__} into a string"
            )
    for key in ("labels", "annotations"):
        value = meta.get(key)
        if value is not None and not (
            isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
        ):
            raise bad_request(f"metadata.{key}: must be a map of strings")


def _is_container(rtype: ResourceType) -> bool:
    """Namespaces and CRDs: deleting one first deletes what lives in it."""
    return rtype.key in (
        ("", "v1", "namespaces"),
        ("apiextensions.k8s.io", "v1", "customresourcedefinitions"),
    )


class ObjectService:
    def __init__(self, store: Store, registry: Registry, clock: Clock | None = None) -> None:
        self.store = store
        self.registry = registry
        self.clock: Clock = clock or (lambda: datetime.datetime.now(datetime.UTC))
        self.garbage_pending = False  # set when a removal may have orphaned dependents

    # ---------------------------------------------------------------- create

    def create(self, rtype: ResourceType, namespace: str | None, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        _check_object_meta(body)
        obj = copy.deepcopy(body)
        obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
        meta = obj.setdefault("metadata", {})
        if rtype.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise bad_request(
                    "the namespace of the provided object does not match the "
                    "namespace sent on the request"
                )
            meta["namespace"] = namespace
            self._require_namespace(namespace)
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(random.choices(_SUFFIX_CHARS, k=5))
        self._validate_name(rtype, meta.get("name"))
        if self.store.get(rtype, meta.get("namespace"), meta["name"]) is not None:
            raise already_exists(rtype, meta["name"])
        for key in _SERVER_OWNED:
            meta.pop(key, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=timestamp(self.clock()), generation=1)
        if rtype.status_subresource:
            obj.pop("status", None)  # status is written through /status only
        self._apply_builtin_defaults(rtype, obj)
        obj = self._validate_custom(rtype, obj, None)
        if rtype.kind == "CustomResourceDefinition":
            self._establish_crd(obj)
        return self.store.write(rtype, obj)

    def _require_namespace(self, namespace: str | None) -> None:
        ns_type = self.registry.get("", "v1", "namespaces")
        assert ns_type is not None and namespace is not None
        ns = self.store.get(ns_type, None, namespace)
        if ns is None:
            raise not_found(ns_type, namespace)
        if ns["metadata"].get("deletionTimestamp"):
            raise ApiError(
                403,
                "Forbidden",
                f"unable to create new content in namespace "
                f"{namespace} because it is being terminated",
                {},
            )

    def _validate_name(self, rtype: ResourceType, name: Any) -> None:
        if not name:
            raise invalid(
                rtype, "", [("metadata.name", "Required value: name or generateName is required")]
            )
        rule = _LABEL if rtype.kind in ("Service", "Namespace") else _NAME
        if (
            not isinstance(name, str)
            or len(name) > (63 if rule is _LABEL else 253)
            or not rule.fullmatch(name)
        ):
            raise invalid(
                rtype,
                str(name),
                [
                    (
                        "metadata.name",
                        f'Invalid value: "{name}": a lowercase '
                        "RFC 1123 name must consist of lower case alphanumeric "
                        "characters, '-' or '.'",
                    )
                ],
            )

    def _apply_builtin_defaults(self, rtype: ResourceType, obj: dict[str, Any]) -> None:
        if rtype.group:
            return
        if rtype.kind == "Pod":
            spec = obj.setdefault("spec", {})
            spec.setdefault("restartPolicy", "Always")
            spec.setdefault("terminationGracePeriodSeconds", 30)
            spec.setdefault("dnsPolicy", "ClusterFirst")
            spec.setdefault("schedulerName", "default-scheduler")
            obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        elif rtype.kind == "Service":
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            if spec.get("clusterIP") != "None":
                serial = self.store.resource_version + 1
                spec["clusterIP"] = f"10.96.{serial // 250 % 250}.{serial % 250 + 1}"
            for port in spec.get("ports", []):
                port.setdefault("protocol", "TCP")
                port.setdefault("targetPort", port.get("port"))
        elif rtype.kind == "Namespace":
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj[
                "metadata"
            ]["name"]
            obj["status"] = {"phase": "Active"}

    def _validate_custom(
        self,
        rtype: ResourceType,
        obj: dict[str, Any],
        old: dict[str, Any] | None,
    ) -> dict[str, Any]:
        if rtype.schema is None:
            return obj
        normalised = rtype.schema.normalise(obj)
        errors = rtype.schema.validate(normalised, old)
        if errors:
            raise invalid(rtype, obj["metadata"].get("name", ""), errors)
        return normalised

    def _establish_crd(self, crd: dict[str, Any]) -> None:
        try:
            self.registry.register_crd(crd)
        except (KeyError, TypeError) as exc:
            raise invalid(
                self._crd_type(),
                crd["metadata"].get("name", ""),
                [("spec", f"Invalid value: {exc}")],
            ) from exc
        now = timestamp(self.clock())
        crd["status"] = {
            "acceptedNames": crd["spec"]["names"],
            "storedVersions": [v["name"] for v in crd["spec"]["versions"] if v.get("storage")],
            "conditions": [
                {"type": t, "status": "True", "reason": r, "message": "", "lastTransitionTime": now}
                for t, r in (
                    ("NamesAccepted", "NoConflicts"),
                    ("Established", "InitialNamesAccepted"),
                )
            ],
        }

    def _crd_type(self) -> ResourceType:
        rtype = self.registry.get("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        assert rtype is not None
        return rtype

    # ---------------------------------------------------------------- update

    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        current = self.store.get(rtype, namespace, name)
        if current is None:
            raise not_found(rtype, name)
        return current

    def replace(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        body: Any,
        subresource: str | None,
    ) -> dict[str, Any]:
        current = self.get(rtype, namespace, name)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        wanted = body.get("metadata", {}).get("resourceVersion")
        if wanted and wanted != current["metadata"]["resourceVersion"]:
            raise conflict(
                rtype,
                name,
                "the object has been modified; please apply your changes "
                "to the latest version and try again",
            )
        return self._update(rtype, current, copy.deepcopy(body), subresource)

    def patch(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        patch: Any,
        content_type: str,
        subresource: str | None,
    ) -> dict[str, Any]:
        current = self.get(rtype, namespace, name)
        try:
            if "json-patch" in content_type:
                new = json_patch(current, patch)
            elif "strategic-merge-patch" in content_type:
                if rtype.group and rtype.crd_name:
                    raise ApiError(
                        415,
                        "UnsupportedMediaType",
                        "strategic merge patch is not "
                        "supported for custom resources; use a merge patch",
                        {},
                    )
                new = strategic_merge_patch(current, patch)
            elif not isinstance(patch, dict):
                raise PatchError(f"a {content_type} patch must be a JSON object", status=400)
            else:  # merge-patch, and apply-patch approximated as a merge
                wanted = patch.get("metadata", {}).get("resourceVersion")
                if wanted and wanted != current["metadata"]["resourceVersion"]:
                    raise conflict(
                        rtype,
                        name,
                        "the object has been modified; please apply your "
                        "changes to the latest version and try again",
                    )
                new = (
                    merge_patch(current, patch)
                    if "apply-patch" not in content_type
                    else strategic_merge_patch(current, patch)
                )
        except PatchError as exc:
            raise ApiError(
                exc.status, "Invalid" if exc.status == 422 else "BadRequest", str(exc), {}
            ) from exc
        return self._update(rtype, current, new, subresource)

    def _update(
        self,
        rtype: ResourceType,
        current: dict[str, Any],
        new: dict[str, Any],
        subresource: str | None,
    ) -> dict[str, Any]:
        name = current["metadata"]["name"]
        if not isinstance(new, dict):
            raise bad_request("the request body must be a JSON object")
        _check_object_meta(new)
        new = copy.deepcopy(new)  # patches share unchanged subtrees with `current`
        if new.get("metadata", {}).get("name", name) != name:
            raise bad_request(
                f"the name of the object ({new['metadata']['name']}) does not match "
                f"the name on the URL ({name})"
            )
        if subresource == "status":
            merged = copy.deepcopy(current)
            merged["status"] = new.get("status", {})
            new = merged
        elif rtype.status_subresource:
            new["status"] = copy.deepcopy(current.get("status"))
            if new["status"] is None:
                new.pop("status")
        new["apiVersion"], new["kind"] = rtype.api_version, rtype.kind
        meta = new.setdefault("metadata", {})
        for key in (*_SERVER_OWNED, "name", "namespace"):
            meta.pop(key, None)
            if key in current["metadata"]:
                meta[key] = current["metadata"][key]
        if current["metadata"].get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(
                current["metadata"].get("finalizers") or []
            )
            if added:
                raise invalid(
                    rtype,
                    name,
                    [
                        (
                            "metadata.finalizers",
                            "Forbidden: no new finalizers "
                            "can be added if the object is being deleted",
                        )
                    ],
                )
        new = self._validate_custom(rtype, new, current)
        if _spec_part(new, rtype) != _spec_part(current, rtype):
            new["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1
        if new == current:
            return current  # a no-op write changes nothing, not even the resourceVersion
        if rtype.kind == "CustomResourceDefinition" and subresource != "status":
            self._establish_crd(new)
        stored = self.store.write(rtype, new)
        return self._finish_if_released(rtype, stored)

    def _finish_if_released(self, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        """Remove an object whose deletion waited only for finalizers / graceful termination."""
        meta = obj["metadata"]
        if (
            meta.get("deletionTimestamp")
            and not meta.get("finalizers")
            and not meta.get("deletionGracePeriodSeconds")
            and not self._blocks_removal(rtype, obj)
        ):
            self.store.remove(rtype, meta.get("namespace"), meta["name"])
            self.garbage_pending = True
        return obj

    def _blocks_removal(self, rtype: ResourceType, obj: dict[str, Any]) -> bool:
        # Namespaces and CRDs go only once their contents are gone (see collect_garbage).
        return _is_container(rtype)

    # ---------------------------------------------------------------- delete

    def delete(
        self, rtype: ResourceType, namespace: str | None, name: str, options: dict[str, Any]
    ) -> dict[str, Any]:
        current = self.get(rtype, namespace, name)
        meta = current["metadata"]
        preconditions = options.get("preconditions") or {}
        for field in ("uid", "resourceVersion"):
            if preconditions.get(field) and preconditions[field] != meta.get(field):
                raise conflict(
                    rtype,
                    name,
                    f"Precondition failed: {field} in precondition: "
                    f"{preconditions[field]}, {field} in object meta: {meta.get(field)}",
                )
        if options.get("propagationPolicy") == "Orphan":
            self._orphan_dependents(meta["uid"])
        grace = self._grace_period(rtype, current, options.get("gracePeriodSeconds"))
        if meta.get("deletionTimestamp"):
            # Already terminating: only a shorter grace (the kubelet's final 0) changes anything.
            if grace == 0 and meta.get("deletionGracePeriodSeconds"):
                meta["deletionGracePeriodSeconds"] = 0
                return self._finish_if_released(rtype, self.store.write(rtype, current))
            return current
        if meta.get("finalizers") or grace > 0 or _is_container(rtype):
            moment = self.clock() + datetime.timedelta(seconds=grace)
            meta["deletionTimestamp"] = timestamp(moment)
            meta["deletionGracePeriodSeconds"] = grace
            if rtype.kind == "Namespace":
                current.setdefault("status", {})["phase"] = "Terminating"
            self.garbage_pending = True
            return self._finish_if_released(rtype, self.store.write(rtype, current))
        removed = self.store.remove(rtype, namespace, name)
        self.garbage_pending = True
        return removed

    def _grace_period(self, rtype: ResourceType, obj: dict[str, Any], requested: Any) -> int:
        if rtype.kind != "Pod" or rtype.group:
            return 0
        # An unscheduled or finished pod has no process to stop: it goes at once, as on a real server.
        if not obj.get("spec", {}).get("nodeName") or obj.get("status", {}).get("phase") in (
            "Succeeded",
            "Failed",
        ):
            return 0
        if requested is not None:
            return max(0, int(requested))
        return int(obj.get("spec", {}).get("terminationGracePeriodSeconds", 30))

    def _orphan_dependents(self, owner_uid: str) -> None:
        for rtype in self.registry.all():
            for obj in self.store.list(rtype, None):
                refs = obj["metadata"].get("ownerReferences") or []
                kept = [r for r in refs if r.get("uid") != owner_uid]
                if len(kept) != len(refs):
                    obj["metadata"]["ownerReferences"] = kept
                    self.store.write(rtype, obj)

    # ---------------------------------------------------------------- garbage collection

    def collect_garbage(self) -> None:
        """Delete dependents of removed owners; finish terminating namespaces and CRDs."""
        while self.garbage_pending:
            self.garbage_pending = False
            everything = [(t, o) for t in self.registry.all() for o in self.store.list(t, None)]
            live_uids = {o["metadata"]["uid"] for _, o in everything}
            for rtype, obj in everything:
                meta = obj["metadata"]
                refs = meta.get("ownerReferences") or []
                if (
                    refs
                    and not meta.get("deletionTimestamp")
                    and not any(r.get("uid") in live_uids for r in refs)
                ):
                    self._delete_quietly(rtype, meta.get("namespace"), meta["name"])
            for rtype, obj in everything:
                if obj["metadata"].get("deletionTimestamp") and _is_container(rtype):
                    self._drain(rtype, obj)

    def _drain(self, rtype: ResourceType, owner: dict[str, Any]) -> None:
        name = owner["metadata"]["name"]
        if rtype.kind == "Namespace":
            members = [
                (t, o)
                for t in self.registry.all()
                if t.namespaced
                for o in self.store.list(t, name)
            ]
        else:
            members = [
                (t, o)
                for t in self.registry.all()
                if t.crd_name == name
                for o in self.store.list(t, None)
            ]
        for mtype, member in members:
            if not member["metadata"].get("deletionTimestamp"):
                self._delete_quietly(
                    mtype, member["metadata"].get("namespace"), member["metadata"]["name"]
                )
        if not members and not owner["metadata"].get("finalizers"):
            self.store.remove(rtype, None, name)
            if rtype.kind == "CustomResourceDefinition":
                self.registry.unregister_crd(name)
            self.garbage_pending = True

    def _delete_quietly(self, rtype: ResourceType, namespace: str | None, name: str) -> None:
        # An ApiError here means it raced with another deletion: nothing left to do.
        with contextlib.suppress(ApiError):
            self.delete(rtype, namespace, name, {})
