"""One restart budget for torchrun inside the pods and the operator (reconcile/budget.py):
each fault's decision as a table, through the real reconcile pass (no scrape: what a pod
leaves when it ends is all the operator is given, as when every scrape was missed)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from finetune_operator.api import metricnames as mn
from finetune_operator.api.constants import ANNOTATION_RESTART_ATTEMPT, COND_FAILED
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import (
    HealthInput,
    PodView,
    ScrapeTarget,
    own_rounds_by_pod,
    reconcile_job,
)
from finetune_operator.reconcile.budget import counts_end, fold_ledger, in_pod_budget
from finetune_operator.reconcile.conditions import find
from finetune_operator.reconcile.disposition import Disposition, classify_exit
from finetune_operator.reconcile.nodeloss import NodeReading, NodeView
from tests.operator.factories import make_plan, quickstart_raw
from tests.operator.test_disposition import STORE_START, ended
from tests.operator.test_reconcile import JOB, T0, deleted, running, step

BUDGET = 3  # the quickstart's maxRestarts
LATER = T0 + timedelta(hours=1)  # every backoff has elapsed


def crashed(
    name: str,
    kind: str | None,
    *,
    restarts: int | None = None,
    rounds: list[str] | None = None,
    end: str | None = None,
    exit_code: int = 1,
    message: str | None = None,
    uid: str | None = None,
) -> PodView:
    """A worker pod that ended: its crash report's kind (None: no report, the container was
    killed from outside), the rounds whose failures of the pod's own its torchrun restarted
    after (`rounds`; `restarts` alone: an image that says only the count) and the round that
    ended it (`end`)."""
    report: dict[str, Any] | None = None
    if kind is not None:
        report = {"crash": {"rank": 0, "kind": kind, "message": message or f"{kind} here"}}
        if rounds is not None:
            report["crash"].update(restarts=len(rounds), rounds=rounds)
        elif restarts is not None:
            report["crash"]["restarts"] = restarts
        if end is not None:
            report["crash"]["round"] = end
    pod = ended(name, exit_code=exit_code, report=report)
    return dataclasses.replace(pod, uid=uid) if uid else pod


def carried(
    name: str, report: dict[str, Any] | None, *, exit_code: int = 143, uid: str | None = None
) -> PodView:
    """A worker pod that ended without a crash report, its launcher's `restarts` (its own
    failures restarted in the pod) beside whatever else it left; made after the current
    store (it joined that store)."""
    pod = ended(
        name, exit_code=exit_code, report=report, started=STORE_START + timedelta(seconds=1)
    )
    return dataclasses.replace(pod, uid=uid) if uid else pod


def store() -> PodView:
    return ended("qs-rdzv", phase="Running", exit_code=0, started=STORE_START)


@pytest.mark.parametrize(
    ("max_restarts", "used", "left"), [(3, 0, 3), (3, 2, 1), (3, 3, 0), (3, 5, 0), (0, 0, 0)]
)
def test_in_pod_budget_is_what_the_job_has_left(max_restarts: int, used: int, left: int) -> None:
    assert in_pod_budget(max_restarts, used) == left


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
        [crashed("qs-worker-1", "Signal", rounds=["a", "b", "c"], end="d"),
         *running("qs-worker-0")],
        0, True, BUDGET, ["qs-worker-0", "qs-worker-1", "qs-rdzv"],
        id="transient-kill-then-crash",
    ),
    pytest.param(
        # One transient kill inside a pod made with 1 restart left, then a crash: failures
        # 3 (in the pod) and 4: beyond the budget.
        [crashed("qs-worker-1", "Exception", rounds=["a"], end="b"), *running("qs-worker-0")],
        2, True, BUDGET, ["qs-worker-0", "qs-worker-1", "qs-rdzv"],
        id="kill-in-a-replacement-spends-what-was-left",
    ),
    pytest.param(
        # Every rank raises at step N, every time: both pods gave up after 3 restarts, in
        # the same rounds: 3 + the end, counted once each: beyond the budget at attempt 4.
        [crashed("qs-worker-0", "Exception", rounds=["a", "b", "c"], end="d"),
         crashed("qs-worker-1", "Exception", rounds=["a", "b", "c"], end="d")],
        0, True, BUDGET, ["qs-worker-0", "qs-worker-1", "qs-rdzv"],
        id="deterministic-crash-every-rank",
    ),
    pytest.param(
        # The same in pods made with 2 restarts left: 2 rounds restarted + the round that
        # ended both = 3, one per round (not one per pod: 6, Failed), within the budget.
        [crashed("qs-worker-0", "Exception", rounds=["a", "b"], end="c"),
         crashed("qs-worker-1", "Exception", rounds=["a", "b"], end="c")],
        0, False, 3, ["qs-worker-0", "qs-worker-1", "qs-rdzv"],
        id="simultaneous-failures-count-once-per-round",
    ),
    pytest.param(
        # An image that says only its counts: each pod's failures counted as its own.
        [crashed("qs-worker-0", "Exception", restarts=1),
         crashed("qs-worker-1", "Exception", restarts=1)],
        0, True, BUDGET, ["qs-worker-0", "qs-worker-1", "qs-rdzv"],
        id="counts-without-rounds-count-per-pod",
    ),
    pytest.param(
        # One rank raises every time; its peer's ranks only lost it (none of its own).
        [crashed("qs-worker-0", "PeerLost", restarts=0),
         crashed("qs-worker-1", "Exception", rounds=["a", "b", "c"], end="d")],
        0, True, BUDGET, ["qs-worker-0", "qs-worker-1", "qs-rdzv"],
        id="deterministic-crash-one-rank",
    ),
    pytest.param(
        # Its torchrun spent its restarts on peers that left (deleted, preempted: torch
        # counts a peer's departure as a failed group, the launcher does not: restarts 0):
        # replaced with the rendezvous it shut down, nothing counted.
        [crashed("qs-worker-1", "PeerLost", rounds=[], end="x"), *running("qs-worker-0")],
        1, False, 1, ["qs-worker-1", "qs-rdzv"],
        id="peer-lost",
    ),
    pytest.param(
        # Pods made at the job's restart 1 (2 left): worker-0 raised twice (its torchrun
        # restarted twice), then worker-1 raised once and both gave up, worker-0's last
        # attempt only losing its peer. Every failed round counts, whichever pod had it:
        # 1 + 2 (worker-0's) + 1 (worker-1's end) = 4, beyond the budget.
        [crashed("qs-worker-0", "PeerLost", rounds=["a", "b"], end="c"),
         crashed("qs-worker-1", "Exception", rounds=[], end="c")],
        1, True, BUDGET, ["qs-worker-0", "qs-worker-1", "qs-rdzv"],
        id="own-restarts-then-peer-lost",
    ),
    pytest.param(
        # A rank hangs at step N every time: the others' collectives time out (the trainer's
        # CollectiveTimeoutError, a PeerLost report), the hung pod's agent restarts it as a
        # membership change; no rank ever raises of its own. The timeouts are the failures
        # (4 of them, as the launcher counts them): Failed, not re-formed forever.
        [crashed("qs-worker-0", "PeerLost", rounds=["a", "b", "c"], end="d",
                 message=TIMED_OUT),
         crashed("qs-worker-1", "PeerLost", rounds=[], end="d")],
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
    raised = crashed("qs-worker-1", "Exception", rounds=["a"], end="b")
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
    rounds = [f"r{k}" for k in range(left)]
    end = crashed("qs-worker-1", "Exception", rounds=rounds, end="last", uid="uid-replacement")
    out = step(out.status, [store(), *running("qs-worker-0"), end], LATER, ensured=1)
    attempts = 1 + left + 1
    assert out.status.phase == "Failed" and attempts == BUDGET + 1
    assert out.status.restarts == BUDGET  # every restart shown, the ones inside the pod too


# --- the restart ledger: each failed round counted once, live and at a pod's end ----------


def page(rounds: list[str]) -> str:
    """A trainer's metrics page as it exports its launcher's failed rounds
    (finetune_trainer/metrics.py)."""
    registry = CollectorRegistry()
    m = mn.TRAINER_OWN_FAILURE_ROUND
    gauge = Gauge(m.family, m.help, m.labels, registry=registry)
    for r in rounds:
        gauge.labels("qs", "0", r).set(1)
    return generate_latest(registry).decode()


def _scraped(status: FineTuneJobStatus, pods: list[PodView], own: dict[str, list[str]]) -> Any:
    """A pass that scraped the running workers (by name here): their pages' rounds."""
    by_name = {p.name: p for p in pods}
    pages = {
        ScrapeTarget(name, f"http://{name}/metrics", 0, uid=by_name[name].uid): page(rounds)
        for name, rounds in own.items()
    }
    health = HealthInput(own_rounds=own_rounds_by_pod(pages))
    return reconcile_job(
        JOB, quickstart_raw(), status, [store(), *pods], LATER,
        planner=lambda _: make_plan(2), ensured_generation=1, health=health,
    )  # fmt: skip


def _start(restarts: int = 0) -> FineTuneJobStatus:
    return step(FineTuneJobStatus(), [], T0).status.model_copy(update={"restarts": restarts})


def test_a_failure_in_every_pod_at_once_is_one_restart() -> None:
    """Every rank raised at the same step (both pods' torchruns restarted their groups after a
    failure of their own, in the same round): one restart, not one per pod; the next round's
    failure is one more."""
    pods = running("qs-worker-0", "qs-worker-1")
    out = _scraped(_start(), pods, {"qs-worker-0": ["r1"], "qs-worker-1": ["r1"]})
    assert (out.status.restarts, out.status.restart_ledger) == (1, ["r1"])
    out = _scraped(out.status, pods, {"qs-worker-0": ["r1", "r2"], "qs-worker-1": ["r1"]})
    assert (out.status.restarts, out.status.restart_ledger) == (2, ["r1", "r2"])
    out = _scraped(out.status, pods, {"qs-worker-0": ["r1", "r2"], "qs-worker-1": ["r1", "r2"]})
    assert (out.status.restarts, out.status.phase) == (2, "Running")


def test_a_restart_seen_live_then_in_the_crash_report_is_counted_once() -> None:
    """worker-1's trainer was killed twice (torchrun restarted it, its trainers say so), then
    it raised with no restart left: its crash report names the same 2 rounds, and its end's
    round is one more."""
    pods = running("qs-worker-0", "qs-worker-1")
    live = _scraped(_start(), pods, {"qs-worker-1": ["a", "b"]})
    assert (live.status.restarts, live.status.restart_ledger) == (2, ["a", "b"])
    again = _scraped(live.status, pods, {"qs-worker-1": ["a", "b"]})
    assert again.status.restarts == 2  # the next scrape adds nothing
    end = crashed("qs-worker-1", "Exception", rounds=["a", "b"], end="c")
    out = _run(again.status, [end, *running("qs-worker-0")])
    assert (out.status.restarts, out.status.restart_ledger) == (3, ["a", "b", "c"])
    assert sorted(deleted(out)) == ["qs-rdzv", "qs-worker-1"]


def test_failures_alternating_between_pods_are_each_counted_and_end_the_job() -> None:
    """A kill in worker-0, then in worker-1, then in each again (each restarted by its own
    torchrun, its peer only losing it): 4 rounds failed, beyond maxRestarts 3 while both pods
    still run."""
    pods = running("qs-worker-0", "qs-worker-1")
    out = _scraped(_start(), pods, {"qs-worker-0": ["a"], "qs-worker-1": []})
    out = _scraped(out.status, pods, {"qs-worker-0": ["a"], "qs-worker-1": ["b"]})
    assert (out.status.restarts, out.status.phase) == (2, "Running")
    # A replacement made now gets what is left: 1.
    replaced = _run(out.status, [crashed("qs-worker-1", None, exit_code=137), pods[0]])
    assert replaced.status.restarts == 3  # the kill from outside: one more, a round alone
    out = _scraped(out.status, pods, {"qs-worker-0": ["a", "c"], "qs-worker-1": ["b"]})
    assert (out.status.restarts, out.status.phase) == (3, "Running")
    out = _scraped(out.status, pods, {"qs-worker-0": ["a", "c"], "qs-worker-1": ["b", "d"]})
    assert (out.status.phase, out.status.restarts) == ("Failed", BUDGET), out.status
    failed = find(out.status.conditions, COND_FAILED)
    assert failed is not None and failed.reason == "BackoffLimitExceeded"
    assert "qs-worker-1 (1 new)" in failed.message and "4 failures" in failed.message
    assert sorted(deleted(out)) == ["qs-rdzv", "qs-worker-0", "qs-worker-1"]


def test_a_kill_before_the_round_had_an_id_counts_alone() -> None:
    """A trainer killed before its group agreed on a round id: its launcher names the attempt
    itself (finetune_trainer/launch.attempt_round), so it is counted beside the round its
    peer failed in, not merged with it."""
    pods = running("qs-worker-0", "qs-worker-1")
    out = _scraped(_start(), pods, {"qs-worker-0": ["r1"], "qs-worker-1": ["p1a2b3c4d-0"]})
    assert out.status.restarts == 2


def test_an_old_status_without_a_ledger_keeps_its_count() -> None:
    """A status written before the ledger (restarts 2, no ids): its count is the floor that
    new rounds add to, and nothing lowers it."""
    pods = running("qs-worker-0", "qs-worker-1")
    out = _scraped(_start(2), pods, {"qs-worker-0": ["a"], "qs-worker-1": ["a"]})
    assert (out.status.restarts, out.status.restart_ledger) == (3, ["a"])
    out = _scraped(out.status, pods, {})
    assert out.status.restarts == 3


def test_new_pods_get_the_budget_left() -> None:
    pods = running("qs-worker-0")
    out = _scraped(_start(), pods, {"qs-worker-0": ["a", "b"]})  # worker-1 is gone: made again
    assert _made(out, "qs-worker-1") == (BUDGET - 2, 2)


@pytest.mark.parametrize("scraped", [True, False], ids=["seen-live", "never-scraped"])
def test_a_kill_then_a_sigterm_of_the_pod_counts_the_kill(scraped: bool) -> None:
    """worker-1's trainer was SIGKILLed (torchrun spent a restart on it: a failure of the
    pod's own), then the pod was stopped (SIGTERM: preempted, drained): the stop is a
    preemption, the kill counts once whether or not a scrape saw it (its launcher carries it
    out in the termination log)."""
    status = _start()
    if scraped:
        status = _scraped(
            status, running("qs-worker-0", "qs-worker-1"), {"qs-worker-1": ["k"]}
        ).status
        assert status.restarts == 1
    report = {"step": 5, "stopReason": "Signal", "restarts": 1, "rounds": ["k"]}
    stopped = carried("qs-worker-1", report)
    assert classify_exit(stopped, STORE_START).disposition is Disposition.PREEMPTED
    out = _run(status, [stopped, *running("qs-worker-0")])
    assert (out.status.restarts, out.status.preemptions) == (1, 1), out.status
    assert deleted(out) == ["qs-worker-1"]
    # Seen again (the pass's status read back, as after an operator restart): no more.
    again = _run(out.status, [stopped, *running("qs-worker-0")])
    assert again.status.restarts == 1


def test_a_closed_rendezvous_end_counts_nothing_but_keeps_the_earlier_own_failures() -> None:
    """Two failures of worker-0's own restarted in the pod, then its peer gave up first and
    shut the rendezvous down: RendezvousClosed (not counted, the store renewed), the 2 kept."""
    report = {"restarts": 2, "rounds": ["a", "b"], "rendezvousClosed": True}
    closed = carried("qs-worker-0", report, exit_code=1)
    assert classify_exit(closed, STORE_START).disposition is Disposition.RENDEZVOUS_CLOSED
    out = _run(_start(1), [closed, *running("qs-worker-1")])
    assert (out.status.restarts, out.status.preemptions) == (3, 1), out.status
    assert sorted(deleted(out)) == ["qs-rdzv", "qs-worker-0"]


def test_a_pod_gone_keeps_its_rounds_counted() -> None:
    """worker-1 restarted twice after its own failures, then was deleted (evicted): its rounds
    stay in the ledger (a peer that reports the same rounds later adds nothing); its
    replacement (same name, a new uid) adds only rounds of its own."""
    out = _scraped(_start(), running("qs-worker-0", "qs-worker-1"), {"qs-worker-1": ["a", "b"]})
    out = _scraped(out.status, running("qs-worker-0"), {"qs-worker-0": ["b"]})
    assert (out.status.restarts, out.status.restart_ledger) == (2, ["a", "b"])
    new = dataclasses.replace(running("qs-worker-1")[0], uid="uid-new")
    out = _scraped(out.status, [*running("qs-worker-0"), new], {"qs-worker-1": ["c"]})
    assert (out.status.restarts, out.status.restart_ledger) == (3, ["a", "b", "c"])


def test_fold_ledger_adds_each_round_once() -> None:
    """Pure: a round reported by two pods is added once (by the first pod by name), a round
    already in the ledger not at all, and a page that says less takes nothing back; only
    workers are read."""
    pods = [*running("qs-worker-0", "qs-worker-1"), store()]
    live = {"uid-qs-worker-0": frozenset({"a", "b"}), "uid-qs-worker-1": frozenset({"b", "c"})}
    ledger, added = fold_ledger(["z"], pods, live)
    assert ledger == ["z", "a", "b", "c"] and added == {
        "qs-worker-0": ["a", "b"],
        "qs-worker-1": ["c"],
    }
    assert fold_ledger(ledger, pods, {}) == (ledger, {})
    assert counts_end(crashed("qs-worker-0", "Exception")) and not counts_end(
        crashed("qs-worker-0", "PeerLost")
    )


# --- a pod lost with its node: the round its peers then fail in is not counted -------------


def test_fold_ledger_skips_forgiven_rounds() -> None:
    pods = running("qs-worker-0")
    live = {"uid-qs-worker-0": frozenset({"lost-round", "own"})}
    ledger, added = fold_ledger([], pods, live, frozenset({"lost-round"}))
    assert ledger == ["own"] and added == {"qs-worker-0": ["own"]}


def _node_lost_pass(status: FineTuneJobStatus, pods: list[PodView], *, at: Any) -> Any:
    """A pass that reads worker-1's node Unknown for long: the frozen worker-1 (deleted by the
    taint eviction) is lost, last seen training in round `lost-round`."""
    down = NodeView("node-b", ready="Unknown", since=at - timedelta(minutes=5))
    reading = NodeReading({"node-b": down}, rounds={"uid-qs-worker-1": "lost-round"})
    return reconcile_job(
        JOB, quickstart_raw(), status, pods, at,
        planner=lambda _: make_plan(2), ensured_generation=1, nodes=reading,
    )  # fmt: skip


def test_the_round_a_pod_was_lost_in_is_not_counted_live_nor_at_an_end() -> None:
    """The survivors' collectives time out on the frozen peer: their torchrun restarts them
    after a failure it must count as their own (a collective timeout: it cannot tell a hang),
    in the round the lost pod was training in. Once the operator knows the pod was lost with
    its node, that round counts nothing: reported live, or in a crash report at the end."""
    frozen = dataclasses.replace(
        running("qs-worker-1")[0],
        node="node-b",
        terminating=True,
        deletion_deadline=LATER - timedelta(seconds=10),
        deletion_grace=30,
    )
    out = _node_lost_pass(_start(), [store(), *running("qs-worker-0"), frozen], at=LATER)
    (loss,) = out.status.node_losses
    assert (loss.pod, loss.node, loss.round) == ("qs-worker-1", "node-b", "lost-round")
    assert out.status.preemptions == 1 and out.status.restarts == 0
    # The survivor re-formed with the replacement: its trainers report the round.
    new = dataclasses.replace(running("qs-worker-1")[0], uid="uid-new")
    live = _scraped(out.status, [*running("qs-worker-0"), new], {"qs-worker-0": ["lost-round"]})
    assert (live.status.restarts, live.status.restart_ledger) == (0, [])
    # A round of the survivor's own afterwards still counts.
    more = _scraped(live.status, [*running("qs-worker-0"), new], {"qs-worker-0": ["lost-round", "x"]})  # fmt: skip
    assert (more.status.restarts, more.status.restart_ledger) == (1, ["x"])
    # A survivor whose torchrun gave up on the timeout: its end, in that round, is not counted.
    timeout = "CollectiveTimeoutError: a collective timed out after 10s"
    end = crashed("qs-worker-0", "PeerLost", rounds=[], end="lost-round", message=timeout)
    assert counts_end(end)  # a collective timeout, in any other round, is counted
    out = _run(live.status, [end, new])
    assert out.status.restarts == 0 and "qs-worker-0" in deleted(out)
