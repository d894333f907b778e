"""A FineTuneJob admitted by Kueue, on the local cluster with Kueue's CRDs served. The test
plays Kueue's part, writing the Workload's status as Kueue's scheduler would: no pod before
admission (the job says why, in Kueue's words); admitted partially (1 of 2 nodes) to a
flavor whose node labels and tolerations the worker gets; evicted mid-training (workers
stopped, nothing counted, the quota given back); admitted again, it resumes from its last
checkpoint and succeeds, and its Workload is marked Finished."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune_local.session import LocalSession, phase_of
from finetune_operator.api.constants import LABEL_JOB, LABEL_ROLE
from finetune_operator.api.schema_validation import CustomResourceSchema
from tests.conftest import wait_until
from tests.e2e.conftest import resumed_steps

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

KUEUE = ("kueue.x-k8s.io", "v1beta2")
NAME, QUEUE, POOL = "ft-kueue", "team-q", {"cloud.example.com/pool": "spot"}
TOLERATION = {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}
STEPS = 16
SCHEMA = Path(__file__).resolve().parents[1] / "data" / "kueue" / "workload-v1beta2-spec.yaml"


def _cond(ctype: str, status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {"type": ctype, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T12:00:00Z"}  # fmt: skip


class PlaysKueue:
    """Writes the job's Workload status the way Kueue's controller does."""

    def __init__(self, session: LocalSession) -> None:
        self.custom = session.custom

    def workload(self) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            found: dict[str, Any] = self.custom.get_namespaced_custom_object(
                *KUEUE, "default", "workloads", NAME
            )
            return found
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def conditions(self) -> dict[str, dict[str, Any]]:
        wl = self.workload() or {}
        return {c["type"]: c for c in (wl.get("status") or {}).get("conditions") or []}

    def _status(self, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            *KUEUE,
            "default",
            "workloads",
            NAME,
            {"status": status},
            _content_type="application/merge-patch+json",
        )

    def no_quota(self, message: str) -> None:
        self._status({"conditions": [_cond("QuotaReserved", "False", "Pending", message)]})

    def admit(self, count: int) -> None:
        others = [
            c
            for t, c in self.conditions().items()
            if t not in ("QuotaReserved", "Admitted", "Evicted")
        ]
        self._status({
            "conditions": [*others, _cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
                           _cond("Admitted", "True", "Admitted", "The workload is admitted"),
                           _cond("Evicted", "False", "QuotaReserved", "Previously: evicted")],
            "admission": {"clusterQueue": "cq", "podSetAssignments": [
                {"name": "workers", "count": count, "flavors": {"cpu": "spot", "memory": "spot"}}]},
        })  # fmt: skip

    def evict(self, message: str) -> None:
        conds = self.conditions()
        conds["Evicted"] = _cond("Evicted", "True", "Preempted", message)
        self._status({"conditions": list(conds.values())})


def _workers(session: LocalSession) -> list[Any]:
    assert session.core is not None
    pods = session.core.list_namespaced_pod("default", label_selector=f"{LABEL_JOB}={NAME}").items
    return [p for p in pods if p.metadata.labels.get(LABEL_ROLE) == "worker"]


def _job_pods(session: LocalSession) -> list[Any]:
    assert session.core is not None
    return list(
        session.core.list_namespaced_pod("default", label_selector=f"{LABEL_JOB}={NAME}").items
    )


def _succeeded_cond(job: dict[str, Any]) -> dict[str, Any]:
    conds = (job.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "Succeeded"), {})


def _checkpoint(job: dict[str, Any]) -> int:
    return int(((job.get("status") or {}).get("lastCheckpoint") or {}).get("step") or 0)


def test_queued_admitted_evicted_readmitted_succeeds(
    quickstart_doc: dict[str, Any], tmp_path: Path
) -> None:
    with LocalSession(tmp_path / "cluster", nodes=2, kueue=True, node_labels=POOL,
                      extra_env={"FT_STEP_DELAY_SECONDS": "0.2"}) as session:  # fmt: skip
        session.custom.create_cluster_custom_object(*KUEUE, "resourceflavors", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "spot"},
            "spec": {"nodeLabels": POOL, "tolerations": [TOLERATION]}})  # fmt: skip
        kueue = PlaysKueue(session)
        doc = quickstart_doc
        doc["metadata"].update(name=NAME, labels={"kueue.x-k8s.io/queue-name": QUEUE})
        doc["spec"]["training"]["maxSteps"] = STEPS
        doc["spec"]["checkpoint"].update(uri=f"checkpoints/{NAME}", intervalSteps=4)
        doc["spec"].pop("output", None)
        session.submit(doc)

        # Queued: the Workload exists (as Kueue's schema wants it), no pod, and the job says why.
        wl = wait_until(kueue.workload, "the job's Workload", timeout=60)
        spec_schema = yaml.safe_load(SCHEMA.read_text())
        assert (
            CustomResourceSchema({"type": "object", "properties": {"spec": spec_schema}}).validate(
                wl
            )
            == []
        )
        assert wl["spec"]["podSets"][0]["count"] == 2 and wl["spec"]["podSets"][0]["minCount"] == 1
        assert wl["metadata"]["ownerReferences"][0]["name"] == NAME
        why = "couldn't assign flavors to pod set workers: insufficient unused quota for cpu in flavor spot"
        kueue.no_quota(why)
        job = session.wait_for(
            NAME, lambda j: why in _succeeded_cond(j).get("message", ""), timeout=60
        )
        assert phase_of(job) == "Pending" and _succeeded_cond(job)["reason"] == "Queued"
        assert QUEUE in _succeeded_cond(job)["message"] and _job_pods(session) == []

        # Admitted at 1 of 2 nodes, to the spot flavor.
        kueue.admit(1)
        job = session.wait_for(NAME, lambda j: _checkpoint(j) >= 4, timeout=240)
        (worker,) = _workers(session)
        assert worker.spec.node_selector == POOL
        assert any(
            t.key == "spot" and t.effect == "NoSchedule" for t in worker.spec.tolerations or []
        )

        # Evicted mid-training: stopped like a suspend, reported, nothing counted; the operator
        # gives the quota back once its pods are gone.
        kueue.evict(
            "Preempted to accommodate a workload (UID: x) due to prioritization in the ClusterQueue"
        )
        job = session.wait_for(
            NAME, lambda j: _succeeded_cond(j).get("reason") == "Evicted" and not _job_pods(session), timeout=120
        )  # fmt: skip
        saved = _checkpoint(job)
        assert phase_of(job) == "Pending" and 4 <= saved < STEPS
        assert (job["status"].get("restarts") or 0) == 0
        released = wait_until(
            lambda: kueue.conditions().get("QuotaReserved", {}).get("status") == "False",
            "the quota given back",
            timeout=30,
        )
        assert released and "admission" not in ((kueue.workload() or {}).get("status") or {})
        # And PodsReady with it, as Kueue's job reconciler: the next admission starts unready.
        assert kueue.conditions().get("PodsReady", {}).get("status") != "True"

        # Admitted again: it resumes from the checkpoint and finishes; the Workload is Finished.
        kueue.admit(1)
        job = session.wait_for(NAME, lambda j: phase_of(j) in ("Succeeded", "Failed"), timeout=300)
        assert phase_of(job) == "Succeeded", job.get("status")
        assert (job["status"].get("restarts") or 0) == 0
        log = session.cluster.pod_log_path("default", f"{NAME}-worker-0")
        assert log is not None and max(resumed_steps(log)) >= saved
        finished = wait_until(
            lambda: kueue.conditions().get("Finished"), "the Workload Finished", timeout=30
        )
        assert finished["status"] == "True" and finished["reason"] == "Succeeded"
        # Finished and no pod running: the operator takes Kueue's resource-in-use finalizer
        # off; deleting the job then lets garbage collection take the Workload.
        wait_until(
            lambda: (
                "kueue.x-k8s.io/resource-in-use"
                not in ((kueue.workload() or {}).get("metadata") or {}).get("finalizers", [])
            ),
            "the finalizer removed",
            timeout=30,
        )
        session.custom.delete_namespaced_custom_object(
            "finetune.dev", "v1alpha1", "default", "finetunejobs", NAME
        )
        wait_until(lambda: kueue.workload() is None, "the Workload collected", timeout=30)
