"""How the operator calls the API server: the API groups a job's children live in, each
call in a worker thread (the kubernetes client is synchronous; kopf's event loop, its watches,
timers and other jobs, must never block on the network) and with a timeout. The base of
`workload_api.WorkloadApi` and `apply.ClusterApi`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from finetune_operator.reconcile.child_errors import object_absent

MERGE_PATCH = "application/merge-patch+json"
# Seconds for one API call: a hung connection must not stall the job's reconcile forever.
REQUEST_TIMEOUT = 10.0


class ApiCalls:
    """The API clients and the one way to call them."""

    def __init__(self, api_client: k8s.ApiClient) -> None:
        self.core = k8s.CoreV1Api(api_client)
        self.networking = k8s.NetworkingV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
        return await asyncio.to_thread(fn, *args, **kwargs)

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

    async def _read_custom(
        self, api_version: str, namespace: str, plural: str, name: str
    ) -> dict[str, Any] | None:
        """The custom object, or None when the object itself is absent (a 404 naming it: see
        child_errors.object_absent); any other refusal is raised for the caller to judge."""
        group, _, version = api_version.rpartition("/")
        try:
            found: dict[str, Any] = await self._call(
                self.custom.get_namespaced_custom_object, group, version, namespace, plural, name
            )
        except ApiException as err:
            if object_absent(err, name):
                return None
            raise
        return found
