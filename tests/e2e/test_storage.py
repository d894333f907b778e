"""Checkpoints on a PersistentVolumeClaim: the job mounts a claim, the local kubelet binds it
to a host directory on first use (as a provisioner would), a killed worker's replacement
resumes from the checkpoints on the claim, and nothing lands in the pods' working directory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from finetune_local.session import LocalSession, is_finished, phase_of
from tests.e2e.conftest import committed_steps, resumed_steps, slowed_session

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
CLAIM = "ft-pvc-shared"


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    yield from slowed_session(tmp_path_factory, "e2e-storage", nodes=3)


def _checkpoint(job: dict[str, Any]) -> int:
    return int((job.get("status", {}).get("lastCheckpoint") or {}).get("step") or 0)


def test_checkpoint_and_resume_through_a_claim(session: LocalSession,
                                               quickstart_doc: dict[str, Any]) -> None:
    assert session.core is not None
    session.core.create_namespaced_persistent_volume_claim("default", {
        "metadata": {"name": CLAIM},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    })  # fmt: skip
    spec = quickstart_doc["spec"]
    quickstart_doc["metadata"]["name"] = "ft-pvc"
    spec["training"]["maxSteps"] = 20
    spec["checkpoint"].update({"uri": "/shared/checkpoints/ft-pvc", "intervalSteps": 5})
    spec["output"]["uri"] = "/shared/output/ft-pvc"
    spec["storage"] = {"claims": [{"claimName": CLAIM, "mountPath": "/shared"}]}
    session.submit(quickstart_doc)
    job = session.wait_for("ft-pvc", lambda j: _checkpoint(j) >= 5, timeout=120)
    at_kill = _checkpoint(job)
    assert session.cluster.kill_pod_processes("default", "ft-pvc-worker-1")
    job = session.wait_for("ft-pvc", is_finished, timeout=180)
    assert phase_of(job) == "Succeeded", job.get("status")
    assert job["status"]["restarts"] >= 1

    claim = session.core.read_namespaced_persistent_volume_claim(CLAIM, "default")
    assert claim.status.phase == "Bound"
    volume = session.data_dir / "pvcs" / "default" / CLAIM
    assert committed_steps(volume / "checkpoints" / "ft-pvc")[-1] == 20
    assert (volume / "output" / "ft-pvc" / "config.json").is_file()
    assert not (session.data_dir / "shared" / "shared").exists()  # not the working directory
    log = session.cluster.pod_log_path("default", "ft-pvc-worker-0")
    assert log is not None
    resumed = resumed_steps(log)
    assert resumed and min(resumed) >= at_kill > 0, (resumed, at_kill)
