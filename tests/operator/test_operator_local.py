"""The real kopf operator, in-process, against the embedded local cluster (slow).

Workers run a fake command (the builders are monkeypatched): worker-1 fails at once, the first
time only; every other worker exits 0 after 5 s, long enough for the replacement (1 s backoff)
to join before worker-0 finishes. Shows create → pods → failed pod replaced → Succeeded.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from finetune_operator.api.constants import GROUP, PLURAL, VERSION
from tests.conftest import wait_until
from tests.operator.factories import quickstart_raw
from tests.operator.inprocess import running_operator

pytestmark = pytest.mark.slow

local = pytest.importorskip("finetune_local.cluster")


@pytest.fixture
def cluster() -> Iterator[Any]:
    # Not under /tmp: every pod mounts an emptyDir over /tmp (read-only root filesystem), which
    # would hide a data dir there (the pods' working directory) from the pod's processes.
    data = Path(tempfile.mkdtemp(prefix="ftjob-op-test-", dir="/var/tmp"))
    try:
        with local.LocalCluster(data / "cluster", nodes=2) as c:
            yield c
    finally:
        shutil.rmtree(data, ignore_errors=True)


def _fake_commands(monkeypatch: pytest.MonkeyPatch, marker: Path) -> None:
    from finetune_operator.resources import rendezvous, worker

    script = (
        f'if [ "$POD_NAME" = quickstart-worker-1 ] && [ ! -e {marker} ]; then '
        f"touch {marker}; exit 1; fi; sleep 5; exit 0"
    )
    monkeypatch.setattr(worker, "worker_command", lambda *_: ["sh", "-c", script])
    monkeypatch.setattr(rendezvous, "rendezvous_command", lambda: ["sleep", "300"])


def _wait(what: str, fn: Any, timeout: float = 60) -> Any:
    return wait_until(fn, what, timeout, interval=0.5)


def test_create_fail_replace_succeed(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_commands(monkeypatch, Path(cluster.data_dir) / "failed-once")
    spec = quickstart_raw()
    spec["faultTolerance"] = {"maxRestarts": 2, "backoffSeconds": 1}
    with running_operator(cluster.kubeconfig_path, interval=1) as (custom, core):
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "FineTuneJob",
            "metadata": {"name": "quickstart"},
            "spec": spec,
        }
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)

        def status() -> dict[str, Any]:
            obj = custom.get_namespaced_custom_object(
                GROUP, VERSION, "default", PLURAL, "quickstart"
            )
            return obj.get("status") or {}

        _wait("pods", lambda: len(core.list_namespaced_pod("default").items) >= 3)
        assert core.read_namespaced_config_map("quickstart-config", "default").data["job.json"]
        try:
            final = _wait("Succeeded", lambda: status().get("phase") == "Succeeded" and status())
        except AssertionError:
            pods = core.list_namespaced_pod("default").items
            raise AssertionError(
                f"{status()}\n" + "\n".join(f"{p.metadata.name} {p.status.phase}" for p in pods)
            ) from None
        assert final["restarts"] == 1
        conds = {c["type"]: c for c in final["conditions"]}
        assert conds["Succeeded"]["status"] == "True"
        assert conds["Failed"]["status"] == "False"
        _wait(
            "rendezvous deleted",
            lambda: (
                "quickstart-rdzv"
                not in {p.metadata.name for p in core.list_namespaced_pod("default").items}
            ),
        )
        events = core.list_namespaced_event("default").items
        assert any(e.reason == "Restarting" for e in events)
