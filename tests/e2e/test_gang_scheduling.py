"""Two gang-scheduled jobs competing for too few node slots on the local cluster, with
Coscheduling installed: the second job holds no node at all while the first runs (without
gang scheduling one of its workers would take the last free slot and wait there), and it is
placed whole once the first gives its nodes back (suspended); the first, resumed, gets a new
PodGroup and waits whole in turn."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from finetune_local.podgroups import GANG_SCHEDULERS
from finetune_local.session import LocalSession, phase_of
from finetune_operator.api.constants import GROUP, PLURAL, VERSION
from tests.conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _job(doc: dict[str, Any], name: str, steps: int) -> dict[str, Any]:
    job = copy.deepcopy(doc)
    job["metadata"]["name"] = name
    spec = job["spec"]
    spec["training"]["maxSteps"] = steps
    spec["resources"].update(minNodes=2, maxNodes=2)
    spec["resources"]["gangScheduling"] = {"scheduler": "coscheduling"}
    spec["checkpoint"] = {"enabled": False}
    spec.pop("output", None)
    return job


def test_second_gang_waits_whole_until_the_first_gives_its_nodes_back(
    quickstart_doc: dict[str, Any], tmp_path: Path
) -> None:
    # 5 nodes of one pod each: job a's store and 2 workers, job b's store, and 1 slot left.
    # No job has to finish: suspending a gives its nodes (and its PodGroup) back.
    with LocalSession(tmp_path / "cluster", nodes=5, node_capacity={"pods": "1"},
                      gang_schedulers=["coscheduling"]) as session:  # fmt: skip
        core = session.core
        assert core is not None

        def workers(job: str) -> list[Any]:
            pods = core.list_namespaced_pod(
                "default", label_selector=f"finetune.dev/job={job}"
            ).items
            live = [p for p in pods if not p.metadata.deletion_timestamp]
            return [p for p in live if p.metadata.labels.get("finetune.dev/role") == "worker"]

        def unschedulable(job: str) -> Callable[[], list[Any] | None]:
            def check() -> list[Any] | None:
                pods = workers(job)
                conds = [
                    c for p in pods for c in p.status.conditions or [] if c.type == "PodScheduled"
                ]
                ok = (
                    len(pods) == 2
                    and len(conds) == 2
                    and all(c.reason == "Unschedulable" for c in conds)
                )
                return pods if ok else None

            return check

        def pod_group(job: str) -> dict[str, Any]:
            group: dict[str, Any] = session.custom.get_namespaced_custom_object(
                "scheduling.x-k8s.io", "v1alpha1", "default", "podgroups", job
            )
            return group

        def play_scheduler(job: str, status: dict[str, Any]) -> None:
            session.custom.patch_namespaced_custom_object_status(
                "scheduling.x-k8s.io", "v1alpha1", "default", "podgroups", job, {"status": status}
            )

        def gang_is(status: str, reason: str) -> Callable[[dict[str, Any]], bool]:
            def check(job: dict[str, Any]) -> bool:
                conds = (job.get("status") or {}).get("conditions") or []
                want = ("GangScheduled", status, reason)
                return any((c["type"], c["status"], c["reason"]) == want for c in conds)

            return check

        def suspend(job: str, value: bool) -> None:
            session.custom.patch_namespaced_custom_object(
                GROUP, VERSION, "default", PLURAL, job, {"spec": {"suspend": value}}
            )

        session.submit(_job(quickstart_doc, "gang-a", 500))
        session.wait_for("gang-a", lambda j: phase_of(j) == "Running", timeout=120)
        session.submit(_job(quickstart_doc, "gang-b", 500))
        pending = wait_until(unschedulable("gang-b"), "gang-b's workers reported unschedulable", 60)
        assert phase_of(session.get("gang-a")) == "Running"
        assert all(p.spec.node_name is None for p in pending)  # not one worker holds a node
        assert all(p.spec.scheduler_name == "scheduler-plugins-scheduler" for p in pending)
        assert "needs 2 pods at once" in pending[0].status.conditions[0].message
        assert pod_group("gang-b")["spec"]["minMember"] == 2
        job_b = session.wait_for(
            "gang-b", lambda j: "Unschedulable" in json.dumps(j.get("status", {})), timeout=30
        )
        assert phase_of(job_b) == "Pending"  # and `kubectl describe ftj gang-b` says why
        # The local scheduler writes no PodGroup status: play Coscheduling's part, and the
        # job reports the gang's wait (GangScheduled), then its placement.
        play_scheduler("gang-b", {"phase": "Pending"})
        job_b = session.wait_for("gang-b", gang_is("False", "WaitingForGang"), timeout=30)
        assert "waiting for gang: 0/2 pods placed" in json.dumps(job_b["status"])

        suspend("gang-a", True)
        session.wait_for("gang-b", lambda j: phase_of(j) == "Running", timeout=120)
        play_scheduler("gang-b", {"phase": "Running", "running": 2})
        session.wait_for("gang-b", gang_is("True", "GangScheduled"), timeout=30)
        assert all(p.spec.node_name for p in workers("gang-b"))
        with pytest.raises(ApiException) as gone:
            pod_group("gang-a")  # given back while suspended
        assert gone.value.status == 404

        # Resumed: a fresh PodGroup, and now it is gang-a that waits whole.
        suspend("gang-a", False)
        wait_until(unschedulable("gang-a"), "resumed gang-a's workers unschedulable", 60)
        assert pod_group("gang-a")["spec"]["minMember"] == 2
        assert all(p.spec.node_name is None for p in workers("gang-a"))


def test_missing_pod_group_crd_makes_the_job_wait_then_start_once_installed(
    quickstart_doc: dict[str, Any], tmp_path: Path
) -> None:
    """No Coscheduling here: the job waits, its condition naming the missing CRD, with no
    worker pod created; installing the CRD lets it go on without anyone touching the job."""
    with LocalSession(tmp_path / "cluster", nodes=2) as session:
        core = session.core
        assert core is not None
        session.submit(_job(quickstart_doc, "gang-c", 500))

        def waiting(job: dict[str, Any]) -> bool:
            conds = {c["type"]: c for c in job.get("status", {}).get("conditions", [])}
            ready = conds.get("WorkersReady", {})
            return ready.get("status") == "False" and "podgroups.scheduling.x-k8s.io" in ready.get(
                "message", ""
            )

        job = session.wait_for("gang-c", waiting, timeout=60)
        assert phase_of(job) == "Pending"
        pods = core.list_namespaced_pod("default", label_selector="finetune.dev/job=gang-c").items
        assert [p.metadata.labels["finetune.dev/role"] for p in pods] == ["rendezvous"]

        client.ApiextensionsV1Api(core.api_client).create_custom_resource_definition(
            GANG_SCHEDULERS["coscheduling"].crd()
        )
        wait_until(
            lambda: (
                len(
                    core.list_namespaced_pod(
                        "default", label_selector="finetune.dev/job=gang-c"
                    ).items
                )
                == 3
            ),
            "gang-c's workers",
            60,
        )
        group = session.custom.get_namespaced_custom_object(
            "scheduling.x-k8s.io", "v1alpha1", "default", "podgroups", "gang-c"
        )
        assert group["spec"]["minMember"] == 2
