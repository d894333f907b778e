"""The only reconcile module that talks to the API server: applies Actions, nothing more.

The kubernetes client is synchronous; each call runs in a worker thread so kopf's event loop
(watches, timers, other jobs) never blocks on the network.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from finetune_operator.api.constants import GROUP, LABEL_ROLE, PLURAL, ROLE_WORKER, VERSION
from finetune_operator.reconcile.actions import Actions, ObjectRef, PodDeletion
from finetune_operator.reconcile.child_errors import (
    POD_GROUP_ADVICE,
    WORKLOAD_ADVICE,
    describe_api_error,
    describe_child_error,
    workload_absent,
)
from finetune_operator.reconcile.workload_patches import finalizer_release_patch
from finetune_operator.resources.podgroup import PLURAL as POD_GROUP_PLURAL
from finetune_operator.resources.workload import (
    FLAVOR_PLURAL,
    KUEUE_API_VERSION,
    KUEUE_GROUP,
    KUEUE_VERSION,
    WORKLOAD_PLURAL,
    PriorityRef,
)

MERGE_PATCH = "application/merge-patch+json"
# Seconds for one API call: a hung connection must not stall the job's reconcile forever.
REQUEST_TIMEOUT = 10.0


@dataclass
class ApplyResult:
    created: list[str] = field(default_factory=list)
    deleted: list[PodDeletion] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def load_api_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG)."""
    if kubeconfig is None:
        try:
            k8s_config.load_incluster_config()  # type: ignore[no-untyped-call]
            return k8s.ApiClient()
        except k8s_config.ConfigException:
            pass
    cfg = k8s.Configuration()
    k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=kubeconfig, client_configuration=cfg
    )
    return k8s.ApiClient(cfg)


class ClusterApi:
    """Create-if-absent, update-if-present and delete for a job's child objects."""

    def __init__(self, api_client: k8s.ApiClient) -> None:
        self.core = k8s.CoreV1Api(api_client)
        self.networking = k8s.NetworkingV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def ensure(self, obj: dict[str, Any]) -> bool:
        """Create `obj`, or merge-patch it to the desired content; True if it was created."""
        kind, ns, name = obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]
        ops: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
            "ConfigMap": (
                self.core.create_namespaced_config_map,
                self.core.patch_namespaced_config_map,
            ),
            "Service": (self.core.create_namespaced_service, self.core.patch_namespaced_service),
            "NetworkPolicy": (
                self.networking.create_namespaced_network_policy,
                self.networking.patch_namespaced_network_policy,
            ),
        }
        create, patch = ops[kind]
        try:
            await self._call(create, ns, obj)
            return True
        except ApiException as err:
            if err.status != 409:
                raise
        await self._call(patch, name, ns, obj, _content_type=MERGE_PATCH)
        return False

    async def _create_custom(self, obj: dict[str, Any], plural: str) -> bool:
        """Create the custom object; False if it exists already (409)."""
        group, _, version = obj["apiVersion"].rpartition("/")
        ns = obj["metadata"]["namespace"]
        try:
            await self._call(
                self.custom.create_namespaced_custom_object, group, version, ns, plural, obj
            )
        except ApiException as err:
            if err.status != 409:
                raise
            return False
        return True

    async def ensure_custom(self, obj: dict[str, Any], plural: str) -> bool:
        """Create the custom object, or merge-patch its spec; True if it was created."""
        if await self._create_custom(obj, plural):
            return True
        group, _, version = obj["apiVersion"].rpartition("/")
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        patch = {"metadata": {"labels": obj["metadata"].get("labels", {})}, "spec": obj["spec"]}
        await self._call(
            self.custom.patch_namespaced_custom_object, group, version, ns, plural, name, patch,
            _content_type=MERGE_PATCH,
        )  # fmt: skip
        return False

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
            found: dict[str, Any] = await self._call(
                self.custom.get_namespaced_custom_object,
                KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOAD_PLURAL, name,
            )  # fmt: skip
            return found, ""
        except ApiException as err:
            if workload_absent(err, name) or (unserved_is_absent and err.status == 404):
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

    async def job_exists(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the FineTuneJob of that name and uid is still there."""
        try:
            job = await self._call(
                self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name
            )
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return bool((job.get("metadata") or {}).get("uid") == uid)

    async def remove(self, namespace: str, ref: ObjectRef) -> bool:
        """Delete the custom object; False when it is already gone (or its kind is)."""
        group, _, version = ref.api_version.rpartition("/")
        try:
            await self._call(
                self.custom.delete_namespaced_custom_object,
                group,
                version,
                namespace,
                ref.plural,
                ref.name,
            )
            return True
        except ApiException as err:
            if err.status == 404:
                return False
            raise

    async def read_pod_group(self, namespace: str, api_version: str, name: str) -> tuple[dict[str, Any] | None, str]:  # fmt: skip
        """The job's PodGroup (None when it does not exist yet), or why it cannot be read. Its
        status only informs the job's conditions, so any refusal is reported, not raised."""
        group, _, version = api_version.rpartition("/")
        try:
            found: dict[str, Any] = await self._call(
                self.custom.get_namespaced_custom_object,
                group, version, namespace, POD_GROUP_PLURAL, name,
            )  # fmt: skip
            return found, ""
        except ApiException as err:
            if workload_absent(err, name):
                return None, ""
            obj = {"apiVersion": api_version, "metadata": {"name": name}}
            return None, describe_child_error(obj, err, POD_GROUP_ADVICE)

    async def create_pod(self, pod: dict[str, Any]) -> bool:
        """Create if absent; False when a pod of that name already exists (409)."""
        try:
            await self._call(self.core.create_namespaced_pod, pod["metadata"]["namespace"], pod)
            return True
        except ApiException as err:
            if err.status == 409:
                return False
            raise

    async def delete_pod(self, namespace: str, victim: PodDeletion) -> bool:
        """Delete that very pod (uid precondition); False when it is already gone or replaced."""
        options = k8s.V1DeleteOptions(
            preconditions=k8s.V1Preconditions(uid=victim.uid or None),
            grace_period_seconds=victim.grace_seconds,
        )
        try:
            await self._call(self.core.delete_namespaced_pod, victim.name, namespace, body=options)
            return True
        except ApiException as err:
            if err.status in (404, 409):
                return False
            raise

    async def apply(self, namespace: str, actions: Actions) -> ApplyResult:
        """Ensure, then delete, then create. Every step is tried; failures are collected so
        one refused object (a quota, say) does not hide the others. Worker pods are created
        only once their PodGroup exists (gang scheduling)."""
        result = ApplyResult()
        for obj in actions.ensure:
            try:
                await self.ensure(obj)
            except ApiException as err:
                result.errors.append(
                    f"{obj['kind']} {obj['metadata']['name']}: {describe_api_error(err)}"
                )
        if actions.workload is not None:
            try:
                await self.ensure_workload(actions.workload, actions.workload_rewrite)
            except ApiException as err:
                result.errors.append(describe_child_error(actions.workload, err, WORKLOAD_ADVICE))
        if actions.workload_deactivate:
            try:
                await self.deactivate_workload(namespace, actions.workload_name)
            except ApiException as err:
                if err.status != 404:  # gone: nothing holds quota
                    result.errors.append(
                        f"Workload {actions.workload_name} (active false): {describe_api_error(err)}"
                    )
        if actions.workload_status is not None:
            try:
                await self.patch_workload_status(
                    namespace, actions.workload_name, actions.workload_status
                )
            except ApiException as err:
                # 409: Kueue wrote it since it was read; the next pass reads it again and
                # decides anew (as controllers requeue on a conflict), nothing to report.
                if err.status != 409:
                    result.errors.append(
                        f"Workload {actions.workload_name} status: {describe_api_error(err)}"
                    )
        if actions.workload_finalizer is not None:
            try:
                await self.patch_workload(
                    namespace, actions.workload_name, actions.workload_finalizer
                )
            except ApiException as err:
                # 404: gone already; 409: written since it was read, decided anew next pass.
                if err.status not in (404, 409):
                    result.errors.append(
                        f"Workload {actions.workload_name} (finalizer): {describe_api_error(err)}"
                    )
        group_ok = True
        if actions.pod_group is not None:
            try:
                await self.ensure_custom(actions.pod_group, POD_GROUP_PLURAL)
            except ApiException as err:
                group_ok = False
                result.errors.append(describe_child_error(actions.pod_group, err, POD_GROUP_ADVICE))
        for ref in actions.remove:
            try:
                await self.remove(namespace, ref)
            except ApiException as err:
                result.errors.append(f"deleting {ref.kind} {ref.name}: {describe_api_error(err)}")
        for victim in actions.delete:
            try:
                if await self.delete_pod(namespace, victim):
                    result.deleted.append(victim)
            except ApiException as err:
                result.errors.append(f"deleting pod {victim.name}: {describe_api_error(err)}")
        for pod in actions.create:
            name = pod["metadata"]["name"]
            if not group_ok and pod["metadata"]["labels"].get(LABEL_ROLE) == ROLE_WORKER:
                continue
            try:
                if await self.create_pod(pod):
                    result.created.append(name)
            except ApiException as err:
                result.errors.append(f"creating pod {name}: {describe_api_error(err)}")
        return result
