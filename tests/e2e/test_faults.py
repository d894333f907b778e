"""Kill a worker's processes mid-run: the job re-forms, resumes from the last committed
checkpoint (not from step 0) and finishes Succeeded. Invalid and infeasible jobs are refused
with the field and the reason, and leave nothing half-created."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from finetune_operator.api.constants import GROUP, LABEL_JOB, PLURAL, VERSION
from finetune_operator.local.session import LocalSession, is_finished, phase_of
from tests.conftest import wait_until
from tests.e2e.conftest import committed_steps, resumed_steps, slowed_session

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    yield from slowed_session(tmp_path_factory, "e2e", nodes=4)


def _step(job: dict[str, Any]) -> int:
    return int(job.get("status", {}).get("step") or 0)


def _checkpoint(job: dict[str, Any]) -> int:
    return int((job.get("status", {}).get("lastCheckpoint") or {}).get("step") or 0)


def test_killed_worker_resumes_from_checkpoint(session: LocalSession, quickstart_doc: dict[str, Any]) -> None:
    quickstart_doc["metadata"]["name"] = "ft-kill"
    quickstart_doc["spec"]["checkpoint"]["uri"] = "checkpoints/ft-kill"
    session.submit(quickstart_doc)
    job = session.wait_for(
        "ft-kill", lambda j: _checkpoint(j) >= 10 and _step(j) >= 15, timeout=240
    )
    assert phase_of(job) == "Running"
    checkpoint_at_kill = _checkpoint(job)

    assert session.cluster.kill_pod_processes("default", "ft-kill-worker-1")
    seen_after_kill: list[int] = []
    job = session.wait_for(
        "ft-kill", is_finished, timeout=300, on_poll=lambda j: seen_after_kill.append(_step(j))
    )
    assert phase_of(job) == "Succeeded", job.get("status")
    status = job["status"]
    assert status["restarts"] >= 1
    assert status["step"] == 60

    # The survivor's trainer re-formed and resumed from a committed checkpoint, not step 0.
    shared = session.data_dir / "shared"
    log = session.cluster.pod_log_path("default", "ft-kill-worker-0")
    assert log is not None
    resumed = resumed_steps(log)
    assert resumed and min(resumed) >= checkpoint_at_kill > 0, (resumed, checkpoint_at_kill)
    assert min(seen_after_kill) >= checkpoint_at_kill
    assert committed_steps(shared / "checkpoints" / "ft-kill")[-1] == 60

    # Deleting the job removes everything it made (ownerReferences), checkpoints stay.
    session.custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "ft-kill")
    assert session.core is not None
    selector = f"{LABEL_JOB}=ft-kill"
    core = session.core

    def remaining() -> list[str]:
        return [
            o.metadata.name
            for o in (
                *core.list_namespaced_pod("default", label_selector=selector).items,
                *core.list_namespaced_service("default", label_selector=selector).items,
                *core.list_namespaced_config_map("default", label_selector=selector).items,
            )
        ]

    wait_until(lambda: not remaining(), "the job's objects to be deleted", 60, 0.5, detail=lambda: str(remaining()))
    assert committed_steps(shared / "checkpoints" / "ft-kill")[-1] == 60


def test_invalid_manifest_refused_with_field(session: LocalSession, quickstart_doc: dict[str, Any]) -> None:
    quickstart_doc["metadata"]["name"] = "ft-invalid"
    quickstart_doc["spec"]["resources"]["minNodes"] = 3  # > maxNodes (2)
    with pytest.raises(ApiException) as err:
        session.submit(quickstart_doc)
    assert err.value.status == 422
    assert "minNodes" in str(err.value.body)
    quickstart_doc["spec"]["resources"]["minNodes"] = 1
    quickstart_doc["spec"]["method"]["type"] = "dpo"
    with pytest.raises(ApiException) as err:
        session.submit(quickstart_doc)
    assert err.value.status == 422 and "spec.method.type" in str(err.value.body)


def test_infeasible_job_fails_with_reason_and_creates_nothing(session: LocalSession, quickstart_doc: dict[str, Any]) -> None:
    doc = quickstart_doc
    doc["metadata"]["name"] = "ft-70b"
    doc["spec"]["model"] = {"name": "meta-llama/Llama-3.1-70B"}
    doc["spec"]["training"].update({"sequenceLength": 2048, "precision": "bf16"})
    doc["spec"]["resources"] = {
        "gpu": {"product": "RTX-4090-24GB", "memoryGiB": 24}, "gpusPerNode": 2, "maxGPUs": 2,
    }
    doc["spec"]["strategy"] = {"type": "auto"}
    session.submit(doc)
    job = session.wait_for("ft-70b", is_finished, timeout=60)
    assert phase_of(job) == "Failed"
    conditions = {c["type"]: c for c in job["status"]["conditions"]}
    assert conditions["Planned"]["status"] == "False"
    assert conditions["Planned"]["reason"] == "PlanInfeasible"
    message = conditions["Planned"]["message"]
    assert "tried" in message.lower() and "GiB" in message, message
    assert session.core is not None
    selector = f"{LABEL_JOB}=ft-70b"
    assert session.core.list_namespaced_pod("default", label_selector=selector).items == []
    assert session.core.list_namespaced_config_map("default", label_selector=selector).items == []
    assert session.core.list_namespaced_service("default", label_selector=selector).items == []


def test_kubectl_get_ftj(session: LocalSession) -> None:
    out = subprocess.run(
        ["kubectl", "--kubeconfig", str(session.cluster.kubeconfig_path), "get", "ftj"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    header = out.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "GPUS", "STRATEGY", "STEP", "RESTARTS", "AGE"], out
    assert "ft-70b" in out and "Failed" in out
