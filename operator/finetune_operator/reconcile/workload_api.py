"""Kueue's objects as the operator reads and writes them: the job's Workload (created,
activated or deactivated, its status and finalizer patched, released once the job is gone),
the ResourceFlavors it is admitted to and its priority class. The reads say why an object
cannot be read (`child_errors.py`) rather than raise, where a refusal must not read as an
absence. Decisions stay in `actions.py` and `workload_patches.py`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from finetune_operator.reconcile.actions import Actions
from finetune_operator.reconcile.api_calls import MERGE_PATCH, ApiCalls
from finetune_operator.reconcile.child_errors import (
    WORKLOAD_ADVICE,
    describe_api_error,
    describe_child_error,
)
from finetune_operator.reconcile.workload_patches import finalizer_release_patch
from finetune_operator.resources.workload import (
    FLAVOR_PLURAL,
    KUEUE_API_VERSION,
    KUEUE_GROUP,
    KUEUE_VERSION,
    WORKLOAD_PLURAL,
    PriorityRef,
)


class WorkloadApi(ApiCalls):
    """Reads and writes of the job's Kueue objects."""

    async def ensure_workload(self, obj: dict[str, Any], rewrite: bool = False) -> bool:
        """Create the job's Workload, or set its `active` (the rest of its spec is Kueue's
        to keep), and its podSets and queueName when `rewrite` (Kueue allows it only while
        it holds no quota); True if it was created."""
        if await self._create_custom(obj, WORKLOAD_PLURAL):
            return True
        group, _, version = obj["apiVersion"].rpartition("/")
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        patch: dict[str, Any] = {"spec": {"active": obj["spec"]["active"]}}
        if rewrite:
            patch["spec"].update(podSets=obj["spec"]["podSets"], queueName=obj["spec"]["queueName"])
        await self._call(
            self.custom.patch_namespaced_custom_object, group, version, ns, WORKLOAD_PLURAL, name, patch,
            _content_type=MERGE_PATCH,
        )  # fmt: skip
        return False

    async def deactivate_workload(self, namespace: str, name: str) -> None:
        """Set the Workload's `active` false: Kueue evicts it (Deactivated) and its quota is
        given back once the pods are gone."""
        await self._call(
            self.custom.patch_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOAD_PLURAL,
            name, {"spec": {"active": False}}, _content_type=MERGE_PATCH,
        )  # fmt: skip

    async def read_workload(
        self, namespace: str, name: str, *, unserved_is_absent: bool = False
    ) -> tuple[dict[str, Any] | None, str]:
        """The job's Workload (None when it does not exist), and why it cannot be read: its
        CRD not served (Kueue uninstalled) or no permission (the chart's kueue.enabled off).
        Only a Workload known absent may be created anew and gate the job as not admitted;
        one that cannot be read says nothing about the admission its running workers have.
        `unserved_is_absent`: for a job leaving Kueue, no Workload exists where none is served."""
        try:
            return await self._read_custom(KUEUE_API_VERSION, namespace, WORKLOAD_PLURAL, name), ""
        except ApiException as err:
            if unserved_is_absent and err.status == 404:
                return None, ""
            if err.status in (403, 404):
                obj = {"apiVersion": KUEUE_API_VERSION, "metadata": {"name": name}}
                return None, describe_child_error(obj, err, WORKLOAD_ADVICE)
            raise

    async def read_flavors(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """The named ResourceFlavors (cluster-scoped); one that cannot be read is left out."""
        out: dict[str, dict[str, Any]] = {}
        for name in names:
            try:
                out[name] = await self._call(
                    self.custom.get_cluster_custom_object,
                    KUEUE_GROUP,
                    KUEUE_VERSION,
                    FLAVOR_PLURAL,
                    name,
                )
            except ApiException as err:
                if err.status not in (403, 404):
                    raise
        return out

    async def read_priority(self, ref: PriorityRef) -> tuple[int | None, str]:
        """The value of the Workload's priority class, or why it cannot be read."""
        try:
            if ref.group == KUEUE_GROUP:
                found = await self._call(
                    self.custom.get_cluster_custom_object,
                    KUEUE_GROUP,
                    KUEUE_VERSION,
                    ref.plural,
                    ref.name,
                )
            else:
                found = await self._call(
                    self.custom.get_cluster_custom_object, ref.group, "v1", ref.plural, ref.name
                )
        except ApiException as err:
            what = f"{ref.kind} {ref.name} ({describe_api_error(err)})"
            if err.status == 404:
                return None, f"{what} does not exist"
            if err.status == 403:
                return (
                    None,
                    f"{what}: the operator may not read {ref.plural}.{ref.group} (chart value kueue.enabled)",
                )
            return None, what
        value = found.get("value")
        if not isinstance(value, int):
            return None, f"{ref.kind} {ref.name} has no integer value"
        return value, ""

    async def patch_workload_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self._call(
            self.custom.patch_namespaced_custom_object_status,
            KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOAD_PLURAL, name, patch,
            _content_type=MERGE_PATCH,
        )  # fmt: skip

    async def patch_workload(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """A merge patch of the Workload itself (its metadata: the finalizer)."""
        await self._call(
            self.custom.patch_namespaced_custom_object,
            KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOAD_PLURAL, name, patch,
            _content_type=MERGE_PATCH,
        )  # fmt: skip

    async def release_workload(self, namespace: str, name: str, owner_uid: str) -> None:
        """Remove the resource-in-use finalizer from the Workload of a deleted job (Kueue's job
        reconciler does so once the job is gone): garbage collection can then delete it.
        Nothing to do when it is absent, not this job's, or Kueue is not served."""
        workload, unreadable = await self.read_workload(namespace, name)
        owners = {
            o.get("uid")
            for o in ((workload or {}).get("metadata") or {}).get("ownerReferences") or []
        }
        if unreadable or workload is None or owner_uid not in owners:
            return
        patch = finalizer_release_patch(workload)
        if patch is None:
            return
        try:
            await self.patch_workload(namespace, name, patch)
        except ApiException as err:
            if err.status not in (404, 409):
                raise

    async def apply_workload(self, namespace: str, actions: Actions) -> list[str]:
        """The Workload's part of a pass (ensure, deactivate, patch its status, its
        finalizer), every step tried; the errors worth reporting."""
        errors: list[str] = []
        if actions.workload is not None:
            try:
                await self.ensure_workload(actions.workload, actions.workload_rewrite)
            except ApiException as err:
                errors.append(describe_child_error(actions.workload, err, WORKLOAD_ADVICE))
        name = actions.workload_name
        status, finalizer = actions.workload_status, actions.workload_finalizer
        # Each patch, what the error says it was, and the statuses that are no error: 404,
        # gone already (nothing holds quota); 409, Kueue wrote it since it was read: the next
        # pass reads it again and decides anew (as controllers requeue on a conflict).
        steps: list[tuple[Callable[[], Awaitable[Any]], str, tuple[int, ...]]] = []
        if actions.workload_deactivate:
            steps.append((lambda: self.deactivate_workload(namespace, name), " (active false)", (404,)))  # fmt: skip
        if status is not None:
            steps.append((lambda: self.patch_workload_status(namespace, name, status), " status", (409,)))  # fmt: skip
        if finalizer is not None:
            steps.append((lambda: self.patch_workload(namespace, name, finalizer), " (finalizer)", (404, 409)))  # fmt: skip
        for call, what, fine in steps:
            try:
                await call()
            except ApiException as err:
                if err.status not in fine:
                    errors.append(f"Workload {name}{what}: {describe_api_error(err)}")
        return errors
