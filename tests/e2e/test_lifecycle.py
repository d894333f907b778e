"""Suspend and resume a running job: nothing is lost, the job continues from its last committed
checkpoint and finishes Succeeded. (An operator restart mid-run, adopting the running pods, is
one of the fault drills of `test_faults.py`, on its long job.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from finetune_local.session import LocalSession, is_finished, phase_of
from finetune_operator.api.constants import GROUP, LABEL_JOB, PLURAL, VERSION
from tests.e2e.conftest import resumed_steps, slowed_session

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
# Room for the suspend (after the checkpoint at step 10) to land mid-run, with steps to go
# after it; no more: each step costs 0.2 s or more.
STEPS = 40


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    yield from slowed_session(tmp_path_factory, "lifecycle", nodes=2)


def _status(job: dict[str, Any]) -> dict[str, Any]:
    return dict(job.get("status") or {})


def _checkpoint(job: dict[str, Any]) -> int:
    return int((_status(job).get("lastCheckpoint") or {}).get("step") or 0)


def _submit(session: LocalSession, doc: dict[str, Any], name: str) -> None:
    doc["metadata"]["name"] = name
    doc["spec"]["checkpoint"]["uri"] = f"checkpoints/{name}"
    doc["spec"]["training"]["maxSteps"] = STEPS
    doc["spec"].pop("output", None)
    session.submit(doc)


def _pods(session: LocalSession, name: str) -> list[Any]:
    assert session.core is not None
    return list(
        session.core.list_namespaced_pod("default", label_selector=f"{LABEL_JOB}={name}").items
    )


def _set_suspend(session: LocalSession, name: str, value: bool) -> None:
    session.custom.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, name, {"spec": {"suspend": value}}
    )


def test_suspend_then_resume_continues_from_checkpoint(
    session: LocalSession, quickstart_doc: dict[str, Any]
) -> None:
    _submit(session, quickstart_doc, "ft-suspend")
    session.wait_for("ft-suspend", lambda j: _checkpoint(j) >= 10, timeout=240)

    _set_suspend(session, "ft-suspend", True)
    job = session.wait_for(
        "ft-suspend", lambda j: phase_of(j) == "Suspended" and not _pods(session, "ft-suspend"),
        timeout=120,
    )  # fmt: skip
    saved = _checkpoint(job)
    assert saved >= 10

    _set_suspend(session, "ft-suspend", False)
    job = session.wait_for("ft-suspend", is_finished, timeout=300)
    assert phase_of(job) == "Succeeded", _status(job)
    assert _status(job)["step"] == STEPS
    log = session.cluster.pod_log_path("default", "ft-suspend-worker-0")
    assert log is not None and max(resumed_steps(log)) >= saved > 0
