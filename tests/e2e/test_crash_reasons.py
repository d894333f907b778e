"""A trainer that raises says why, at `kubectl describe ftj`: the real operator, the local
cluster (whose kubelet fills `state.terminated.message` as a kubelet does), torchrun and gloo.
Rank 1 raises at step 1, every time, in a job allowed one restart: the job fails with
BackoffLimitExceeded after two attempts in all (one restart budget for torchrun inside the pod
and the operator: reconcile/budget.py), `status.restarts` shows the restart torchrun made
inside the pod, and the condition and Warning Event name the rank, the exception and where it
was raised, not only "exit code 1"."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from finetune_local.session import LocalSession, is_finished, phase_of
from finetune_operator.api.constants import COND_FAILED

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

JOB = "ft-crash"
CAUSE = "rank 1: RuntimeError: injected fault at step 1 on rank 1 (faults.py:"
# The last line of the raising rank's traceback, once per attempt (torchrun's summary indents
# its copy, the crash report line prefixes it).
RAISED = re.compile(r"^RuntimeError: injected fault at step 1 on rank 1$", re.MULTILINE)


@pytest.fixture
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    data = tmp_path_factory.mktemp("crash") / "cluster"
    env = {"FT_CRASH_AT_STEP": "1", "FT_CRASH_RANK": "1"}
    with LocalSession(data, nodes=3, extra_env=env) as s:
        yield s


def test_a_raising_rank_is_named_in_the_failed_condition_and_event(
    session: LocalSession, quickstart_doc: dict[str, Any]
) -> None:
    doc = {**quickstart_doc, "metadata": {"name": JOB}, "spec": dict(quickstart_doc["spec"])}
    doc["spec"]["faultTolerance"] = {"maxRestarts": 1, "backoffSeconds": 1}
    doc["spec"]["checkpoint"] = {**doc["spec"]["checkpoint"], "uri": f"checkpoints/{JOB}"}
    doc["spec"].pop("output", None)
    session.submit(doc)
    job = session.wait_for(JOB, is_finished, timeout=180)
    assert phase_of(job) == "Failed", job.get("status")
    failed = next(c for c in job["status"]["conditions"] if c["type"] == COND_FAILED)
    assert failed["reason"] == "BackoffLimitExceeded", failed
    assert CAUSE in failed["message"] and len(failed["message"]) < 1024, failed
    # Attempts in all, over every pod the job ever had: maxRestarts + 1 (before: the pod's
    # torchrun had all of maxRestarts, then the operator replaced it, up to maxRestarts
    # times); the restart torchrun made inside the pod is counted in status.restarts.
    # Each pod instance has its own directory (name-uid), so every pod ever made is read.
    logs = sorted((session.data_dir / "pods" / "default").glob(f"{JOB}-worker-*/trainer.log"))
    raised = sum(len(RAISED.findall(log.read_text(errors="replace"))) for log in logs)
    assert raised == 2, [log.read_text(errors="replace")[-3000:] for log in logs]
    assert job["status"]["restarts"] == 1, job["status"]

    assert session.core is not None
    events = [e for e in session.core.list_namespaced_event("default").items
              if e.involved_object.name == JOB and e.type == "Warning"]  # fmt: skip
    assert any(e.reason == "BackoffLimitExceeded" and CAUSE in e.message for e in events), [
        (e.reason, e.message) for e in events
    ]
