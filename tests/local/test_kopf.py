"""kopf against the emulator: login, CRD discovery, watching, patching status, finalizers."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import kopf
import pytest
from kubernetes import client

from finetune_local.cluster import LocalCluster
from tests.conftest import wait_until

pytestmark = pytest.mark.slow


def _wait(predicate: Any, timeout: float = 20.0) -> Any:
    return wait_until(predicate, "the kopf handler's effect", timeout)


def test_kopf_handler_patches_status_and_releases_finalizer(
    api_cluster: LocalCluster, new_api_client: Any
) -> None:
    registry = kopf.OperatorRegistry()
    deleted: list[str] = []

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=api_cluster.api_url, insecure=True)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.watching.server_timeout = 10
        settings.posting.enabled = True

    @kopf.on.create("test.dev", "v1", "widgets", registry=registry)
    def created(spec: Any, patch: kopf.Patch, **_: Any) -> None:
        patch.status["phase"] = f"Sized{spec['size']}"

    @kopf.on.delete("test.dev", "v1", "widgets", registry=registry)
    def removed(name: str, **_: Any) -> None:
        deleted.append(name)

    stop = threading.Event()
    ready = threading.Event()

    def run() -> None:
        asyncio.run(
            kopf.operator(
                registry=registry,
                clusterwide=True,
                standalone=True,
                stop_flag=stop,
                ready_flag=ready,
            )
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert ready.wait(20)
        custom = client.CustomObjectsApi(new_api_client(api_cluster))
        body = {
            "apiVersion": "test.dev/v1",
            "kind": "Widget",
            "metadata": {"name": "kopfed"},
            "spec": {"size": 5},
        }
        custom.create_namespaced_custom_object("test.dev", "v1", "default", "widgets", body)

        def get() -> dict[str, Any]:
            return custom.get_namespaced_custom_object(  # type: ignore[no-any-return]
                "test.dev", "v1", "default", "widgets", "kopfed"
            )

        obj = _wait(lambda: (o := get()).get("status", {}).get("phase") and o)
        assert obj["status"]["phase"] == "Sized5"
        assert obj["metadata"].get("finalizers")  # kopf's own, for the delete handler
        custom.delete_namespaced_custom_object("test.dev", "v1", "default", "widgets", "kopfed")

        def gone() -> bool:
            try:
                get()
            except client.ApiException as exc:
                return exc.status == 404
            return False

        _wait(gone)
        assert deleted == ["kopfed"]
    finally:
        stop.set()
        thread.join(timeout=20)
