"""One restart budget for torchrun inside the pods and the operator (reconcile/budget.py):
each fault's decision as a table, through the real reconcile pass (no scrape: what a pod
leaves when it ends is all the operator is given, as when every scrape was missed)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest

from finetune_operator.api.constants import ANNOTATION_RESTART_ATTEMPT
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import PodView
from finetune_operator.reconcile.budget import failure_number, in_pod_budget, restarts_after
from finetune_operator.reconcile.disposition import Disposition, classify_exit
from tests.operator.test_disposition import STORE_START, ended
from tests.operator.test_reconcile import T0, deleted, running, step

BUDGET = 3  # the quickstart's maxRestarts
LATER = T0 + timedelta(hours=1)  # every backoff has elapsed


def crashed(
    name: str,
    kind: str | None,
    *,
    before: int | None = 0,
    restarts: int | None = None,
    exit_code: int = 1,
    message: str | None = None,
) -> PodView:
    """A worker pod that ended: its crash report's kind (None: no report, the container was
    killed from outside) and how often its torchrun restarted the group first; `before`: the
    job's restarts when the operator made it (its annotation; None: no annotation)."""
    report: dict[str, Any] | None = None
    if kind is not None:
        report = {"crash": {"rank": 0, "kind": kind, "message": message or f"{kind} here"}}
        if restarts is not None:
            report["crash"]["restarts"] = restarts
    pod = ended(name, exit_code=exit_code, report=report)
    return dataclasses.replace(pod, restarts_before=before)


def store() -> PodView:
    return ended("qs-rdzv", phase="Running", exit_code=0, started=STORE_START)


@pytest.mark.parametrize(
    ("max_restarts", "used", "left"), [(3, 0, 3), (3, 2, 1), (3, 3, 0), (3, 5, 0), (0, 0, 0)]
)
def test_in_pod_budget_is_what_the_job_has_left(max_restarts: int, used: int, left: int) -> None:
    assert in_pod_budget(max_restarts, used) == left


@pytest.mark.parametrize(
    ("pod", "restarts", "number"),
    [
        # Gave up after 2 restarts inside a pod made at the job's restart 1: failure 4.
        pytest.param(crashed("qs-worker-0", "Exception", before=1, restarts=2), 1, 4, id="report"),
        # Its ranks only lost a peer: the peer's failure, or a peer taken away.
        pytest.param(crashed("qs-worker-0", "PeerLost", restarts=3), 0, None, id="peer-lost"),
        # No report (OOMKilled, a SIGKILL of the pod): one more failure.
        pytest.param(crashed("qs-worker-0", None, exit_code=137), 2, 3, id="killed-outside"),
        # A report but no annotation (a pod made by an older operator): one more failure.
        pytest.param(
            crashed("qs-worker-0", "Exception", before=None, restarts=2), 2, 3, id="no-annotation"
        ),
    ],
)
def test_failure_number(pod: PodView, restarts: int, number: int | None) -> None:
    assert failure_number(pod, restarts) == number


def test_restarts_after_counts_the_pods_restarts_and_its_replacement() -> None:
    assert restarts_after(1, 4, replaced=False) == 3  # restarted 3 times in all so far
    assert restarts_after(1, 4, replaced=True) == 4
    assert restarts_after(5, 4, replaced=True) == 5  # already counted (another pod)
    assert restarts_after(2, None, replaced=True) == 2


def _run(status: FineTuneJobStatus, pods: list[PodView]) -> Any:
    return step(status, [store(), *pods], LATER, ensured=1)


TIMED_OUT = (
    "CollectiveTimeoutError: a collective timed out after 300s: a peer stopped answering (node "
    "lost, network partition, or a hung rank); torchrun re-forms the group. RuntimeError: "
    "[gloo] Timed out waiting 300000ms for recv operation to complete"
)

# Each row: the failed pods a pass sees (with running peers), the job's restarts before; then
# what the pass decides: phase Failed or not, status.restarts, the pods deleted.
CASES = [
    pytest.param(
        # A trainer SIGKILLed once: its torchrun restarted it (budget 3), then the same pod
        # crashed for good with its 2 remaining restarts spent. All 3 in-pod restarts count:
        # the fourth failure is beyond the budget.
        [crashed("qs-worker-1", "Signal", restarts=3), *running("qs-worker-0")],
        0, True, BUDGET, ["qs-worker-0", "qs-worker-1", "qs-rdzv"],
        id="transient-kill-then-crash",
    ),
    pytest.param(
        # One transient kill inside a pod made with 1 restart left, then a crash: failures
        # 3 (in the pod) and 4: beyond the budget.
        [crashed("qs-worker-1", "Exception", before=2, restarts=1), *running("qs-worker-0")],
        2, True, BUDGET, ["qs-worker-0", "qs-worker-1", "qs-rdzv"],
        id="kill-in-a-replacement-spends-what-was-left",
    ),
    pytest.param(
        # Every rank raises at step N, every time: both pods gave up after 3 restarts on the
        # same 4 failures. Counted once (3 restarts, 4 attempts), not pods x events.
        [crashed("qs-worker-0", "Exception", restarts=3),
         crashed("qs-worker-1", "Exception", restarts=3)],
        0, True, BUDGET, ["qs-worker-0", "qs-worker-1", "qs-rdzv"],
        id="deterministic-crash-every-rank",
    ),
    pytest.param(
        # One rank raises every time; its peer's ranks only lost it.
        [crashed("qs-worker-0", "PeerLost", restarts=3),
         crashed("qs-worker-1", "Exception", restarts=3)],
        0, True, BUDGET, ["qs-worker-0", "qs-worker-1", "qs-rdzv"],
        id="deterministic-crash-one-rank",
    ),
    pytest.param(
        # Its torchrun spent its restarts on peers that left (deleted, preempted: torch
        # counts a peer's departure as a failed group, the launcher does not: restarts 0):
        # replaced with the rendezvous it shut down, nothing counted.
        [crashed("qs-worker-1", "PeerLost", restarts=0), *running("qs-worker-0")],
        1, False, 1, ["qs-worker-1", "qs-rdzv"],
        id="peer-lost",
    ),
    pytest.param(
        # Pods made at the job's restart 1 (2 left): worker-0 raised twice (its torchrun
        # restarted twice), then worker-1 raised once and both gave up, worker-0's last
        # attempt only losing its peer. worker-0's own restarts still happened: 3, not the
        # 2 that worker-1's number alone says (the true count, 4 failures, is one more: the
        # undercount of failures alternating between pods, README "Not done yet").
        [crashed("qs-worker-0", "PeerLost", before=1, restarts=2),
         crashed("qs-worker-1", "Exception", before=1, restarts=0)],
        1, False, BUDGET, ["qs-worker-0", "qs-worker-1", "qs-rdzv"],
        id="own-restarts-then-peer-lost",
    ),
    pytest.param(
        # A rank hangs at step N every time: the others' collectives time out (the trainer's
        # CollectiveTimeoutError, a PeerLost report), the hung pod's agent restarts it as a
        # membership change; no rank ever raises of its own. The timeouts are the failures
        # (4 of them, as the launcher counts them): Failed, not re-formed forever.
        [crashed("qs-worker-0", "PeerLost", restarts=3, message=TIMED_OUT),
         crashed("qs-worker-1", "PeerLost", restarts=0)],
        0, True, BUDGET, ["qs-worker-0", "qs-worker-1", "qs-rdzv"],
        id="hang-every-attempt",
    ),
    pytest.param(
        # A preempted pod (graceful SIGTERM, the trainer saved): replaced, not counted.
        [ended("qs-worker-1", report={"step": 5, "stopReason": "Signal"}),
         *running("qs-worker-0")],
        2, False, 2, ["qs-worker-1"],
        id="preemption",
    ),
    pytest.param(
        # A join needs no pass at all: torchrun re-forms without a failure. Nothing ended.
        running("qs-worker-0", "qs-worker-1"),
        1, False, 1, [],
        id="join",
    ),
    pytest.param(
        # The container killed from outside (OOMKilled): no report, one more failure.
        [crashed("qs-worker-1", None, exit_code=137), *running("qs-worker-0")],
        1, False, 2, ["qs-worker-1"],
        id="killed-outside-no-report",
    ),
    pytest.param(
        # An agent that ended on an error of its own (exit 1, no report: an import error, a
        # rendezvous timeout): one more failure, and the rendezvous it shut down replaced.
        [crashed("qs-worker-1", None, exit_code=1), *running("qs-worker-0")],
        1, False, 2, ["qs-worker-1", "qs-rdzv"],
        id="agent-error-no-report",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("pods", "before", "fails", "restarts", "deletes"), CASES)
def test_one_budget(
    pods: list[PodView], before: int, fails: bool, restarts: int, deletes: list[str]
) -> None:
    status = step(FineTuneJobStatus(), [], T0).status.model_copy(update={"restarts": before})
    out = _run(status, pods)
    assert (out.status.phase == "Failed", out.status.restarts) == (fails, restarts), out.status
    assert sorted(deleted(out)) == sorted(deletes)


def _made(out: Any, name: str) -> tuple[int, int]:
    """The created pod's torchrun budget (--max-restarts) and restart-attempt annotation."""
    pod = next(p for p in out.actions.create if p["metadata"]["name"] == name)
    flag = next(a for a in pod["spec"]["containers"][0]["command"] if a.startswith("--max-re"))
    return int(flag.split("=")[1]), int(pod["metadata"]["annotations"][ANNOTATION_RESTART_ATTEMPT])


def test_a_failure_outlives_the_store_it_closed() -> None:
    """The store replaced after an agent gave up: a pod that failed of its own before is still
    counted (its report says its group failed), one that died of the store is not."""
    fresh = dataclasses.replace(store(), created_at=LATER - timedelta(seconds=1))
    raised = crashed("qs-worker-1", "Exception", restarts=1, before=1)
    lost = crashed("qs-worker-0", None)  # its agent lost the closed store: no report
    status = step(FineTuneJobStatus(), [], T0).status.model_copy(update={"restarts": 1})
    out = step(status, [fresh, raised, lost], LATER, ensured=1)
    assert (out.status.restarts, out.status.preemptions) == (3, 1), out.status
    assert sorted(deleted(out)) == ["qs-rdzv", "qs-worker-0", "qs-worker-1"]


CLOSED_TAIL = """[rank1]: Traceback (most recent call last):
  File "/venv/torch/distributed/elastic/rendezvous/dynamic_rendezvous.py", line 1142, in next_rendezvous
    self._op_executor.run(join_op, deadline, self._get_deadline)
torch.distributed.elastic.rendezvous.api.RendezvousClosedError
"""


def test_a_worker_that_found_the_rendezvous_closed_counts_nothing_and_renews_the_store() -> None:
    """Another agent gave up (its failure counted there) and shut the rendezvous down; this
    pod's agent, joining it again, exits 1 with RendezvousClosedError in its log's tail."""
    worker = ended("qs-worker-0", started=STORE_START + timedelta(seconds=1))
    worker = dataclasses.replace(worker, termination_message=CLOSED_TAIL)
    assert classify_exit(worker, STORE_START).disposition is Disposition.RENDEZVOUS_CLOSED
    status = step(FineTuneJobStatus(), [], T0).status.model_copy(update={"restarts": 1})
    out = step(status, [store(), worker, *running("qs-worker-1")], LATER, ensured=1)
    assert (out.status.restarts, out.status.preemptions) == (1, 1), out.status
    assert sorted(deleted(out)) == ["qs-rdzv", "qs-worker-0"]
    # Joined an older store: that store is gone, the usual lost rendezvous.
    old = dataclasses.replace(worker, created_at=STORE_START - timedelta(seconds=1))
    assert classify_exit(old, STORE_START).disposition is Disposition.RENDEZVOUS_LOST


def test_missed_scrapes_still_bound_the_attempts() -> None:
    """A trainer that fails every time, an operator that never scrapes it: each pod's torchrun
    may restart only what the job has left, and each pod's end spends what it used, so the job
    is Failed after maxRestarts + 1 attempts in all, whichever layer made them (before: each
    pod's torchrun had all of maxRestarts, about (maxRestarts + 1)^2 attempts)."""
    first = step(FineTuneJobStatus(), [], T0)
    assert _made(first, "qs-worker-1") == (BUDGET, 0)
    # Attempt 1: the container is OOM-killed (no report): one failure, the pod replaced.
    killed = crashed("qs-worker-1", None, exit_code=137)
    out = step(first.status, [store(), *running("qs-worker-0"), killed], LATER, ensured=1)
    assert (deleted(out), out.status.restarts) == (["qs-worker-1"], 1)
    out = step(out.status, [store(), *running("qs-worker-0")], LATER, ensured=1)
    left, before = _made(out, "qs-worker-1")
    assert (left, before) == (BUDGET - 1, 1)
    # Attempts 2-4: the replacement's trainer raises each time; its torchrun restarts it
    # `left` times, then gives up and says so.
    end = crashed("qs-worker-1", "Exception", before=before, restarts=left)
    out = step(out.status, [store(), *running("qs-worker-0"), end], LATER, ensured=1)
    attempts = 1 + left + 1
    assert out.status.phase == "Failed" and attempts == BUDGET + 1
    assert out.status.restarts == BUDGET  # every restart shown, the ones inside the pod too
