"""Applies a pass's Actions to the API server, nothing more: with `workload_api.py` and
`api_calls.py`, the only reconcile modules that talk to it.

`ClusterApi` creates, patches and deletes the pods, Services, ConfigMaps, NetworkPolicies and
PodGroups; it inherits the Kueue Workload I/O from `workload_api.py` and the call machinery
(worker thread, timeout) from `api_calls.py`; the texts of refused children come from
`child_errors.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from finetune_operator.api.constants import GROUP, LABEL_ROLE, PLURAL, ROLE_WORKER, VERSION
from finetune_operator.reconcile.actions import Actions, ObjectRef, PodDeletion
from finetune_operator.reconcile.api_calls import MERGE_PATCH
from finetune_operator.reconcile.child_errors import (
    POD_GROUP_ADVICE,
    describe_api_error,
    describe_child_error,
    object_absent,
)
from finetune_operator.reconcile.nodeloss import NodeView, absent_node, view_node
from finetune_operator.reconcile.workload_api import WorkloadApi
from finetune_operator.resources.podgroup import PLURAL as POD_GROUP_PLURAL


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


class ClusterApi(WorkloadApi):
    """Create-if-absent, update-if-present and delete for a job's child objects."""

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
        try:
            return await self._read_custom(api_version, namespace, POD_GROUP_PLURAL, name), ""
        except ApiException as err:
            obj = {"apiVersion": api_version, "metadata": {"name": name}}
            return None, describe_child_error(obj, err, POD_GROUP_ADVICE)

    async def read_node(self, name: str) -> tuple[NodeView | None, str]:
        """The Node (absent: a view saying so), or why it cannot be read (a 403: the operator
        may not get nodes, the chart's ClusterRole grants it). Reported, never raised: a pass
        that cannot judge a lost node goes on with everything else."""
        try:
            node = await self._call(self.core.read_node, name)
        except ApiException as err:
            if object_absent(err, name):
                return absent_node(name), ""
            if err.status == 403:
                return None, (
                    f"the operator may not read node {name} ({describe_api_error(err)}): grant "
                    "it get on nodes, as the chart's ClusterRole does"
                )
            return None, f"node {name}: {describe_api_error(err)}"
        return view_node(self.core.api_client.sanitize_for_serialization(node)), ""

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
        result.errors += await self.apply_workload(namespace, actions)
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
