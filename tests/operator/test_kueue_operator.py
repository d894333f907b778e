"""The real kopf operator, in-process, against the embedded local cluster serving Kueue's
CRDs (slow): a Workload event, or a change of the queue-name label, reaches its job at once.
With a 60 s reconcile interval, the workers of an admitted job are created within seconds of
the admission, and stopped within seconds of the label's removal, not at the next pass; and
once they are gone, it leaves Kueue and runs without it within seconds too."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from finetune_operator.api.constants import GROUP, LABEL_JOB, PLURAL, VERSION
from tests.conftest import wait_until
from tests.operator.factories import quickstart_raw
from tests.operator.inprocess import running_operator

pytestmark = pytest.mark.slow

local = pytest.importorskip("finetune_local.cluster")
KUEUE = ("kueue.x-k8s.io", "v1beta2")
INTERVAL = 60


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Any]:
    with local.LocalCluster(tmp_path / "cluster", kubelet=False, kueue=True) as c:
        yield c


def _admitted(count: int) -> dict[str, Any]:
    conds = [{"type": t, "status": "True", "reason": t, "message": "", "lastTransitionTime": "2026-01-01T12:00:00Z"}
             for t in ("QuotaReserved", "Admitted")]  # fmt: skip
    assignment = {"name": "workers", "count": count}
    return {"status": {"conditions": conds,
                       "admission": {"clusterQueue": "cq", "podSetAssignments": [assignment]}}}  # fmt: skip


def _succeeded_reason(custom: Any) -> str | None:
    job = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "queued")
    conds = {c["type"]: c for c in (job.get("status") or {}).get("conditions") or []}
    reason = conds.get("Succeeded", {}).get("reason")
    return reason if reason == "QueueLabelRemoved" else None


def test_an_admission_reaches_the_job_before_its_next_pass(cluster: Any) -> None:
    with running_operator(cluster.kubeconfig_path, INTERVAL) as (custom, core):
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "FineTuneJob",
                "metadata": {"name": "queued", "labels": {"kueue.x-k8s.io/queue-name": "q"}},
                "spec": quickstart_raw()}  # fmt: skip
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)

        def workload() -> dict[str, Any] | None:
            found = custom.list_namespaced_custom_object(*KUEUE, "default", "workloads")["items"]
            return found[0] if found else None

        wait_until(workload, "the job's Workload", 30, interval=0.2)

        def workers() -> list[Any]:
            pods = core.list_namespaced_pod("default", label_selector=f"{LABEL_JOB}=queued").items
            return [p for p in pods if p.metadata.name.startswith("queued-worker")]

        # Past the job's first timer pass (1 s after it is seen): the next is INTERVAL away.
        time.sleep(3)
        assert workers() == []
        admitted_at = time.monotonic()
        custom.patch_namespaced_custom_object_status(
            *KUEUE, "default", "workloads", "queued", _admitted(2)
        )
        wait_until(lambda: len(workers()) == 2, "the admitted workers", INTERVAL / 2, interval=0.2)
        assert time.monotonic() - admitted_at < INTERVAL / 2
        # The queue-name label removed: the job leaves Kueue now (its handler, not the next
        # pass), its workers stopped first (found through status.workload).
        job = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "queued")
        assert job["status"]["workload"] == "queued"
        time.sleep(3)  # the passes the admission set off (the Workload's PodsReady) are over
        unlabel = {"metadata": {"labels": {"kueue.x-k8s.io/queue-name": None}}}
        custom.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "queued", unlabel)
        wait_until(lambda: workers() == [], "the workers stopped", INTERVAL / 2, interval=0.2)
        reason = wait_until(lambda: _succeeded_reason(custom), "the job's reason", 10, interval=0.2)
        assert reason == "QueueLabelRemoved"
        # Their deletion nudges the job: its Workload is deleted (the quota given back) and it
        # runs without Kueue within seconds, not at the next pass.
        wait_until(lambda: workload() is None, "the Workload deleted", INTERVAL / 4, interval=0.2)
        wait_until(lambda: len(workers()) == 2, "the workers outside Kueue", INTERVAL / 4, interval=0.2)  # fmt: skip


def _condition(custom: Any, name: str, ctype: str) -> dict[str, Any]:
    job = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name)
    conds = {c["type"]: c for c in (job.get("status") or {}).get("conditions") or []}
    found: dict[str, Any] = conds.get(ctype, {})
    return found


def test_the_label_added_to_a_running_job_waits_for_it_to_be_suspended(cluster: Any) -> None:
    """Through the label's own handler: the workers stay, no Workload is written, the job
    says why; suspended, it is handed to Kueue (an inactive Workload)."""
    with running_operator(cluster.kubeconfig_path, INTERVAL) as (custom, core):
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "FineTuneJob",
                "metadata": {"name": "plain"}, "spec": quickstart_raw()}  # fmt: skip
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)

        def workers() -> list[str]:
            pods = core.list_namespaced_pod("default", label_selector=f"{LABEL_JOB}=plain").items
            return [p.metadata.name for p in pods if p.metadata.name.startswith("plain-worker")]

        def workloads() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = custom.list_namespaced_custom_object(*KUEUE, "default", "workloads")["items"]  # fmt: skip
            return found

        wait_until(lambda: len(workers()) == 2, "the workers", 30, interval=0.2)
        label = {"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "q"}}}
        custom.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "plain", label)
        applied = wait_until(
            lambda: _condition(custom, "plain", "QueueLabelApplied"), "the condition", 10, interval=0.2
        )  # fmt: skip
        assert (applied["status"], applied["reason"]) == ("False", "AddedWhileRunning")
        assert len(workers()) == 2 and workloads() == []
        suspend = {"spec": {"suspend": True}}
        custom.patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "plain", suspend)
        (wl,) = wait_until(workloads, "the Workload", 10, interval=0.2)
        assert wl["spec"]["active"] is False and wl["spec"]["queueName"] == "q"
        wait_until(lambda: workers() == [], "the workers stopped", 10, interval=0.2)
