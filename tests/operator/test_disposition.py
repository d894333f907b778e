"""Failures (counted against maxRestarts) told apart from preemptions and lost rendezvous
stores (not counted): the pure classification, then the reconcile pass that acts on it."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from finetune_operator.api.constants import LABEL_JOB, LABEL_ROLE, LABEL_WORKER_INDEX
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import PodView, observe_pod
from finetune_operator.reconcile.disposition import Disposition, classify_exit
from tests.operator.test_reconcile import T0, created, deleted, iso, running, step

STORE_START = T0


def ended(
    name: str = "qs-worker-1",
    *,
    phase: str = "Failed",
    exit_code: int = 1,
    report: dict[str, Any] | None = None,
    reason: str | None = None,
    disruption: str | None = None,
    started: Any = T0 + timedelta(seconds=5),
) -> PodView:
    role = "rendezvous" if name.endswith("rdzv") else "worker"
    labels = {LABEL_JOB: "qs", LABEL_ROLE: role}
    if role == "worker":
        labels[LABEL_WORKER_INDEX] = name.rsplit("-", 1)[1]
    term: dict[str, Any] = {"exitCode": exit_code, "finishedAt": iso(T0 + timedelta(seconds=60))}
    if report is not None:
        term["message"] = json.dumps(report)
    status: dict[str, Any] = {
        "phase": phase,
        "containerStatuses": [{"name": "c", "state": {"terminated": term}}],
        "conditions": [],
    }
    if reason:
        status["reason"] = reason
    if disruption:
        status["conditions"].append(
            {"type": "DisruptionTarget", "status": "True", "reason": disruption}
        )
    meta = {"name": name, "uid": f"uid-{name}", "labels": labels, "creationTimestamp": iso(started)}
    return observe_pod({"metadata": meta, "spec": {"nodeName": "n"}, "status": status})


@pytest.mark.parametrize(
    ("pod", "store_started", "expected"),
    [
        pytest.param(ended(), STORE_START, Disposition.FAILURE, id="crash"),
        pytest.param(ended(exit_code=137), STORE_START, Disposition.FAILURE, id="oom-or-sigkill"),
        pytest.param(
            ended(report={"step": 5, "stopReason": "Signal"}),
            STORE_START,
            Disposition.PREEMPTED,
            id="graceful-sigterm-report",
        ),
        pytest.param(
            ended(report={"step": 5}), STORE_START, Disposition.FAILURE, id="report-no-stop"
        ),
        pytest.param(
            ended(exit_code=143), STORE_START, Disposition.PREEMPTED, id="died-of-sigterm"
        ),
        pytest.param(
            ended(reason="Evicted"), STORE_START, Disposition.PREEMPTED, id="kubelet-eviction"
        ),
        pytest.param(
            ended(disruption="TerminationByKubelet"),
            STORE_START,
            Disposition.PREEMPTED,
            id="node-shutdown",
        ),
        pytest.param(
            ended(disruption="EvictionByEvictionAPI"),
            STORE_START,
            Disposition.PREEMPTED,
            id="eviction-api",
        ),
        pytest.param(ended(), None, Disposition.RENDEZVOUS_LOST, id="store-gone"),
        pytest.param(
            ended(),
            T0 + timedelta(seconds=30),
            Disposition.RENDEZVOUS_LOST,
            id="store-replaced-after-worker-creation",
        ),
        pytest.param(
            ended(started=T0 + timedelta(seconds=40)),
            T0 + timedelta(seconds=30),
            Disposition.FAILURE,
            id="worker-created-after-current-store",
        ),
        pytest.param(
            ended(started=T0 + timedelta(seconds=30)),
            T0 + timedelta(seconds=30),
            Disposition.FAILURE,
            id="created-in-the-same-pass-as-the-store",
        ),
        pytest.param(
            ended("qs-rdzv", phase="Succeeded", exit_code=0),
            None,
            Disposition.PREEMPTED,
            id="store-stopped",
        ),
        pytest.param(ended("qs-rdzv"), None, Disposition.FAILURE, id="store-crashed"),
    ],
)
def test_classify_exit(pod: PodView, store_started: Any, expected: Disposition) -> None:
    assert classify_exit(pod, store_started).disposition is expected


def _store() -> PodView:
    return ended("qs-rdzv", phase="Running", exit_code=0, started=STORE_START)


def _status(**kw: Any) -> FineTuneJobStatus:
    first = step(FineTuneJobStatus(), [], T0)
    return first.status.model_copy(update=kw)


def test_preempted_worker_is_replaced_at_once_and_not_counted() -> None:
    status = _status(restarts=2)  # budget 3 in the quickstart: one left
    pods = [_store(), *running("qs-worker-0"),
            ended(report={"step": 5, "stopReason": "Signal"})]  # fmt: skip
    out = step(status, pods, T0 + timedelta(seconds=61), ensured=1)
    assert deleted(out) == ["qs-worker-1"]  # no backoff
    assert out.status.restarts == 2 and out.status.preemptions == 1
    assert [(e.type, e.reason) for e in out.actions.events] == [("Normal", "Preempted")]
    assert out.status.phase != "Failed"


def test_lost_store_does_not_spend_the_budget_twice_over() -> None:
    """The store's pod stopped (deleted by SIGTERM: exit 0), then both workers died of it;
    the budget is nearly spent, yet nothing is counted and everything is replaced."""
    status = _status(restarts=3)  # budget exhausted: one counted failure would fail the job
    store = ended("qs-rdzv", phase="Succeeded", exit_code=0, started=STORE_START)
    workers = [ended("qs-worker-0"), ended("qs-worker-1")]
    out = step(status, [store, *workers], T0 + timedelta(seconds=61), ensured=1)
    assert sorted(deleted(out)) == ["qs-rdzv", "qs-worker-0", "qs-worker-1"]
    assert out.status.restarts == 3 and out.status.preemptions == 3
    assert out.status.phase != "Failed"
    # Next pass: all three gone, all three created again.
    again = step(out.status, [], T0 + timedelta(seconds=62), ensured=1)
    assert created(again) == ["qs-rdzv", "qs-worker-0", "qs-worker-1"]
    assert again.status.preemptions == 3


def test_real_failure_is_still_counted_and_fails_the_job_at_the_limit() -> None:
    status = _status(restarts=3)
    out = step(status, [_store(), *running("qs-worker-0"), ended()], T0 + timedelta(seconds=61),
               ensured=1)  # fmt: skip
    assert out.status.phase == "Failed" and out.status.preemptions == 0


def test_no_worker_is_created_while_the_store_goes_away() -> None:
    status = _status()
    store_going = ended("qs-rdzv", phase="Running", exit_code=0)
    store_going = store_going.__class__(**{**store_going.__dict__, "terminating": True})
    out = step(status, [store_going], T0 + timedelta(seconds=61), ensured=1)
    assert created(out) == []
    out = step(status, [], T0 + timedelta(seconds=62), ensured=1)
    assert created(out) == ["qs-rdzv", "qs-worker-0", "qs-worker-1"]
