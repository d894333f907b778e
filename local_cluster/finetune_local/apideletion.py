"""How objects leave the API server: deletion and garbage collection.

Preconditions, graceful pod deletion (a deletionTimestamp, then the kubelet's final delete),
finalizers, Orphan propagation, and background propagation: dependents of a removed owner
(by ownerReferences) are deleted after it, and a terminating namespace or CRD goes once what
lives in it is gone.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

from finetune_local.apiadmission import Clock
from finetune_local.apiresources import Registry, ResourceType
from finetune_local.apistore import ApiError, Store, conflict, not_found
from finetune_local.podstatus import timestamp


def is_container(rtype: ResourceType) -> bool:
    """Namespaces and CRDs: deleting one first deletes what lives in it."""
    return rtype.key in (
        ("", "v1", "namespaces"),
        ("apiextensions.k8s.io", "v1", "customresourcedefinitions"),
    )


class Deletions:
    def __init__(self, store: Store, registry: Registry, clock: Clock) -> None:
        self.store = store
        self.registry = registry
        self.clock = clock
        self.garbage_pending = False  # set when a removal may have orphaned dependents

    def delete(
        self, rtype: ResourceType, namespace: str | None, name: str, options: dict[str, Any]
    ) -> dict[str, Any]:
        current = self.store.get(rtype, namespace, name)
        if current is None:
            raise not_found(rtype, name)
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
                return self.finish_if_released(rtype, self.store.write(rtype, current))
            return current
        if meta.get("finalizers") or grace > 0 or is_container(rtype):
            moment = self.clock() + datetime.timedelta(seconds=grace)
            meta["deletionTimestamp"] = timestamp(moment)
            meta["deletionGracePeriodSeconds"] = grace
            if rtype.kind == "Namespace":
                current.setdefault("status", {})["phase"] = "Terminating"
            self.garbage_pending = True
            return self.finish_if_released(rtype, self.store.write(rtype, current))
        removed = self.store.remove(rtype, namespace, name)
        self.garbage_pending = True
        return removed

    def finish_if_released(self, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        """Remove an object whose deletion waited only for finalizers / graceful termination."""
        meta = obj["metadata"]
        if (
            meta.get("deletionTimestamp")
            and not meta.get("finalizers")
            and not meta.get("deletionGracePeriodSeconds")
            # Namespaces and CRDs go only once their contents are gone (see collect_garbage).
            and not is_container(rtype)
        ):
            self.store.remove(rtype, meta.get("namespace"), meta["name"])
            self.garbage_pending = True
        return obj

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
                if obj["metadata"].get("deletionTimestamp") and is_container(rtype):
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
