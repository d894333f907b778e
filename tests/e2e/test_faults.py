"""The end-to-end fault suite: the real operator, the local cluster, torchrun and gloo on CPU.

One long job goes through a sequence of independent faults (each waits for the previous one to
be recovered), so the suite pays for one cluster and one job: per fault it asserts the outcome,
the steps redone (at most one checkpoint interval; two where the newest checkpoint was
destroyed), what was counted (`status.restarts`: failures; `status.preemptions`: not), and it
prints the recovery time (fault -> training past the step it had reached). A second job runs
beside it on the same cluster. `test_run_cleanup.py` covers two clusters on one host and
killing `ftjob run`. Invalid and infeasible jobs are refused with the field and the reason.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from finetune_local.session import LocalSession, is_finished, phase_of
from finetune_operator.api.constants import GROUP, LABEL_JOB, PLURAL, VERSION
from tests.conftest import wait_until
from tests.e2e.conftest import committed_steps, slowed_session
from tests.e2e.faults import FAULTS_JOB, FAULTS_STEPS, faults_job, run_drills

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    yield from slowed_session(tmp_path_factory, "e2e", nodes=6)


# ~3 minutes on a quiet 2-core machine; seen taking 10 at load 12 (two end-to-end runs beside
# other work): more than the suite's 600 s per test.
@pytest.mark.timeout(900)
def test_fault_sequence_on_one_long_job(
    session: LocalSession, quickstart_doc: dict[str, Any]
) -> None:
    doc = faults_job(quickstart_doc)
    second = faults_job(quickstart_doc, "ft-second", steps=25)
    session.submit(doc)
    session.submit(second)  # two jobs at once on one local cluster
    results = run_drills(session)
    print("\nrecovery times: " + ", ".join(f"{x.fault}: {x.seconds:.1f} s" for x in results))

    job = session.wait_for(FAULTS_JOB, is_finished, timeout=300)
    status = job["status"]
    assert phase_of(job) == "Succeeded", status
    # The drills' failures: three trainers killed or stopped inside their pods (worker-1, then
    # worker-0 twice: each counted, tests/e2e/faults.py) and one pod killed.
    assert status["restarts"] == 4 and status["step"] == FAULTS_STEPS, status
    # Counted by round: the three trainers killed while training, each in a round whose id
    # the trainers agreed on (random, 16 hex: reconcile/budget.py), and the pod's end.
    ledger = status["restartLedger"]
    agreed = [r for r in ledger if re.fullmatch(r"[0-9a-f]{16}", r)]
    assert len(ledger) == 4 and len(set(agreed)) == 3, ledger
    assert status["preemptions"] >= 1, status
    root = session.data_dir / "shared" / "checkpoints" / FAULTS_JOB
    assert committed_steps(root)[-1] == FAULTS_STEPS

    other = session.wait_for("ft-second", is_finished, timeout=120)
    assert phase_of(other) == "Succeeded", other.get("status")
    assert other["status"]["restarts"] == 0

    # Deleting the job removes everything it made (ownerReferences), checkpoints stay.
    session.custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, FAULTS_JOB)
    assert session.core is not None
    core = session.core
    selector = f"{LABEL_JOB}={FAULTS_JOB}"

    def remaining() -> list[str]:
        return [
            o.metadata.name
            for o in (
                *core.list_namespaced_pod("default", label_selector=selector).items,
                *core.list_namespaced_service("default", label_selector=selector).items,
                *core.list_namespaced_config_map("default", label_selector=selector).items,
            )
        ]

    wait_until(
        lambda: not remaining(),
        "the job's objects to be deleted",
        60,
        0.5,
        detail=lambda: str(remaining()),
    )
    assert committed_steps(root)[-1] == FAULTS_STEPS


def test_invalid_manifest_refused_with_field(
    session: LocalSession, quickstart_doc: dict[str, Any]
) -> None:
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


def test_infeasible_job_fails_with_reason_and_creates_nothing(
    session: LocalSession, quickstart_doc: dict[str, Any]
) -> None:
    doc = quickstart_doc
    doc["metadata"]["name"] = "ft-70b"
    doc["spec"]["model"] = {"name": "meta-llama/Llama-3.1-70B"}
    doc["spec"]["training"].update({"sequenceLength": 2048, "precision": "bf16"})
    doc["spec"]["resources"] = {
        "gpu": {"product": "RTX-4090-24GB", "memoryGiB": 24},
        "gpusPerNode": 2,
        "maxGPUs": 2,
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
