"""The write semantics of the API server: what create, update and patch do to objects.

Kept apart from HTTP so that it reads as the list of rules a real API server applies:
metadata (uid, creationTimestamp, generation, generateName), namespaces, the status
subresource, CRD schemas and finalizers. What is checked and defaulted on an object is
:mod:`.apiadmission`; deletion and garbage collection (graceful pod deletion, ownerReferences
with background propagation) are :mod:`.apideletion`.
"""

from __future__ import annotations

import copy
import datetime
import uuid
from typing import Any

from finetune_local.apiadmission import (
    SERVER_OWNED,
    Clock,
    apply_builtin_defaults,
    check_no_new_finalizers,
    check_object_meta,
    established_crd_status,
    generated_name,
    spec_part,
    validate_custom,
    validate_name,
)
from finetune_local.apideletion import Deletions
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
from finetune_local.podstatus import timestamp


def _check_resource_version(rtype: ResourceType, current: dict[str, Any], body: Any) -> None:
    """An update or merge patch that names a resourceVersion applies to that version only."""
    wanted = body.get("metadata", {}).get("resourceVersion")
    if wanted and wanted != current["metadata"]["resourceVersion"]:
        raise conflict(
            rtype,
            current["metadata"]["name"],
            "the object has been modified; please apply your changes "
            "to the latest version and try again",
        )


class ObjectService:
    """Create, read, update, patch and delete, as the API server does them on its store."""

    def __init__(self, store: Store, registry: Registry, clock: Clock | None = None) -> None:
        self.store = store
        self.registry = registry
        self.clock: Clock = clock or (lambda: datetime.datetime.now(datetime.UTC))
        self.deletions = Deletions(store, registry, self.clock)

    @property
    def garbage_pending(self) -> bool:
        """Whether a removal may have orphaned dependents (collect_garbage then)."""
        return self.deletions.garbage_pending

    def delete(
        self, rtype: ResourceType, namespace: str | None, name: str, options: dict[str, Any]
    ) -> dict[str, Any]:
        return self.deletions.delete(rtype, namespace, name, options)

    def collect_garbage(self) -> None:
        self.deletions.collect_garbage()

    # ---------------------------------------------------------------- create

    def create(self, rtype: ResourceType, namespace: str | None, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        check_object_meta(body)
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
            meta["name"] = generated_name(meta["generateName"])
        validate_name(rtype, meta.get("name"))
        if self.store.get(rtype, meta.get("namespace"), meta["name"]) is not None:
            raise already_exists(rtype, meta["name"])
        for key in SERVER_OWNED:
            meta.pop(key, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=timestamp(self.clock()), generation=1)
        if rtype.status_subresource:
            obj.pop("status", None)  # status is written through /status only
        apply_builtin_defaults(rtype, obj, self.store.resource_version + 1)
        obj = validate_custom(rtype, obj, None)
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

    def _establish_crd(self, crd: dict[str, Any]) -> None:
        try:
            self.registry.register_crd(crd)
        except (KeyError, TypeError) as exc:
            raise invalid(
                self._crd_type(),
                crd["metadata"].get("name", ""),
                [("spec", f"Invalid value: {exc}")],
            ) from exc
        crd["status"] = established_crd_status(crd, timestamp(self.clock()))

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
        _check_resource_version(rtype, current, body)
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
                _check_resource_version(rtype, current, patch)
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
        check_object_meta(new)
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
        for key in (*SERVER_OWNED, "name", "namespace"):
            meta.pop(key, None)
            if key in current["metadata"]:
                meta[key] = current["metadata"][key]
        check_no_new_finalizers(rtype, current, meta)
        new = validate_custom(rtype, new, current)
        if spec_part(new, rtype) != spec_part(current, rtype):
            new["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1
        if new == current:
            return current  # a no-op write changes nothing, not even the resourceVersion
        if rtype.kind == "CustomResourceDefinition" and subresource != "status":
            self._establish_crd(new)
        stored = self.store.write(rtype, new)
        return self.deletions.finish_if_released(rtype, stored)
