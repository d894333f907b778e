"""A lost node spends no restart (reconcile/forgiveness.py): the pure rule, table-driven over
what the operator knows and the order the survivors' report and the loss's verdict arrive in,
then whole passes of an elastic job (the report first, in the same pass, after)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest

from finetune_operator.api.constants import COND_WORKERS_READY
from finetune_operator.api.status import FineTuneJobStatus, NodeLoss
from finetune_operator.reconcile import HealthInput, Outcome, PodView, reconcile_job
from finetune_operator.reconcile.conditions import find
from finetune_operator.reconcile.forgiveness import (
    HOLD_SLACK_SECONDS,
    budget_hold,
    forgive_lost_rounds,
    taken_back,
)
from finetune_operator.reconcile.nodeloss import LostPod, NodeReading, NodeView, absent_node
from tests.operator.factories import make_plan, quickstart_raw
from tests.operator.test_nodeloss import NODE_LOST, at, node, terminating
from tests.operator.test_reconcile import JOB, running

SEEN = at(-5)  # the operator last scraped the lost pod training in its round: before the loss
LOST_POD = terminating()  # worker-1, on node-b, Unknown since at(0), evicted at(NODE_LOST)


def lost(round_id: str | None = "R", seen: datetime | None = SEEN, **kw: Any) -> LostPod:
    return LostPod(LOST_POD, kw.get("view", node()), NODE_LOST + 2.0, round_id, seen)


@pytest.mark.parametrize(
    ("pods", "ledger", "forgiven", "counted_at", "ahead", "back"),
    [
        # Its round not reported yet (a fixed-size job's survivors wait for the replacement;
        # or the report comes in this very pass): never counted.
        ([lost()], [], [], {}, {"R"}, {}),
        ([lost()], ["E"], [], {"E": at(20)}, {"R"}, {}),
        # The survivors reported it first (an elastic job re-forms alone): taken back.
        ([lost()], ["E", "R"], [], {"E": at(-60), "R": at(12)}, set(), {"R": "qs-worker-1"}),
        # Counted before the pod was last seen in it: a genuine failure it re-formed after
        # (its new round unseen): kept, and the first round counted since the node went
        # down is the node's.
        ([lost()], ["R", "X"], [], {"R": at(-10), "X": at(12)}, set(), {"X": "qs-worker-1"}),
        ([lost()], ["R"], [], {"R": at(-10)}, set(), {}),
        # Its round never seen: the first round counted once its node was down.
        ([lost(None, None)], ["E", "X", "Y"], [], {"E": at(-1), "X": at(12), "Y": at(30)},
         set(), {"X": "qs-worker-1"}),
        ([lost(None, None)], ["E"], [], {"E": at(-1)}, set(), {}),
        # Nothing says when they were counted (before this operator started): kept.
        ([lost()], ["R"], [], {}, set(), {}),
        ([lost(None, None)], ["X"], [], {}, set(), {}),
        # Forgiven already (an earlier pass, or a pod lost before in the same round).
        ([lost()], ["R"], ["R"], {"R": at(12)}, set(), {}),
        ([lost(None, None)], ["X"], ["X"], {"X": at(12)}, set(), {}),
        # The node deleted: no time it went down, only its seen round can be the node's.
        ([lost(None, None, view=absent_node("node-b"))], ["X"], [], {"X": at(12)}, set(), {}),
        ([lost(view=absent_node("node-b"))], ["R"], [], {"R": at(12)}, set(),
         {"R": "qs-worker-1"}),
    ],
    ids=[
        "unreported-ahead", "unreported-beside-a-genuine-failure", "reported-first-taken-back",
        "stale-round-then-the-first-since-down", "stale-round-nothing-since",
        "unseen-first-since-down", "unseen-nothing-since-down", "counted-before-start",
        "unseen-counted-before-start", "already-forgiven", "unseen-already-forgiven",
        "node-gone-unseen", "node-gone-seen",
    ],
)  # fmt: skip
def test_the_rounds_a_lost_pod_accounts_for(
    pods: list[LostPod],
    ledger: list[str],
    forgiven: list[str],
    counted_at: Mapping[str, datetime],
    ahead: set[str],
    back: dict[str, str],
) -> None:
    f = forgive_lost_rounds(pods, ledger, forgiven, counted_at)
    assert (set(f.ahead), dict(f.taken_back)) == (ahead, back)


def test_each_lost_pod_accounts_for_one_round_and_pods_of_one_round_for_it_once() -> None:
    other = replace(LOST_POD, name="qs-worker-2", uid="uid-qs-worker-2")
    two = [lost(None, None), LostPod(other, node(), 62.0)]
    counted = {"X": at(12), "Y": at(13), "Z": at(14)}
    f = forgive_lost_rounds(two, ["X", "Y", "Z"], [], counted)
    assert dict(f.taken_back) == {"X": "qs-worker-1", "Y": "qs-worker-2"}
    same = [lost(), LostPod(other, node(), 62.0, "R", SEEN)]
    f = forgive_lost_rounds(same, ["R", "X"], [], {"R": at(12), "X": at(13)})
    assert dict(f.taken_back) == {"R": "qs-worker-1"}


# Whole passes of an elastic 2-of-2 job (minNodes 1): worker-1's node goes silent at 0,
# worker-0's collective times out and its torchrun re-forms alone, reporting round R.


def elastic_step(
    status: FineTuneJobStatus,
    pods: list[PodView],
    now: datetime,
    own: Mapping[str, list[str]] | None = None,
    reading: NodeReading | None = None,
    max_restarts: int = 5,
) -> Outcome:
    raw = quickstart_raw()
    raw["faultTolerance"]["nodeLostSeconds"] = NODE_LOST
    raw["faultTolerance"]["maxRestarts"] = max_restarts
    raw["resources"]["minNodes"] = 1
    health = HealthInput(own_rounds={f"uid-{k}": frozenset(v) for k, v in (own or {}).items()})
    return reconcile_job(
        JOB, raw, status, pods, now,
        planner=lambda _: make_plan(2), ensured_generation=1, health=health, nodes=reading,
    )  # fmt: skip


def reading(counted_at: Mapping[str, datetime]) -> NodeReading:
    uid = LOST_POD.uid
    return NodeReading(
        {"node-b": node()}, rounds={uid: "R"}, seen_at={uid: SEEN}, counted_at=counted_at
    )


SURVIVOR = running("qs-rdzv", "qs-worker-0")
NOT_YET = replace(LOST_POD, deletion_deadline=None, terminating=False)  # not evicted yet


def test_the_survivors_report_first_then_the_loss_takes_it_back() -> None:
    out = elastic_step(FineTuneJobStatus(), [*SURVIVOR, NOT_YET], at(12), {"qs-worker-0": ["R"]})
    assert (out.status.restarts, out.status.restart_ledger) == (1, ["R"])
    out = elastic_step(
        out.status, [*SURVIVOR, LOST_POD], at(NODE_LOST + 2), {"qs-worker-0": ["R"]},
        reading({"R": at(12)}),
    )  # fmt: skip
    s = out.status
    assert (s.restarts, s.restart_ledger, s.forgiven_rounds) == (0, [], ["R"])
    assert [d.name for d in out.actions.delete] == ["qs-worker-1"]
    # The survivor goes on exporting R, and its end may report it again: never counted.
    out = elastic_step(s, SURVIVOR, at(NODE_LOST + 20), {"qs-worker-0": ["R"]})
    assert (out.status.restarts, out.status.forgiven_rounds) == (0, ["R"])
    # A genuine failure afterwards still counts.
    out = elastic_step(out.status, SURVIVOR, at(NODE_LOST + 40), {"qs-worker-0": ["R", "G"]})
    assert (out.status.restarts, out.status.restart_ledger) == (1, ["G"])


def test_a_report_in_the_pass_that_finds_the_pod_lost_is_never_counted() -> None:
    out = elastic_step(
        FineTuneJobStatus(), [*SURVIVOR, LOST_POD], at(NODE_LOST + 2), {"qs-worker-0": ["R"]},
        reading({}),
    )  # fmt: skip
    s = out.status
    assert (s.restarts, s.restart_ledger, s.forgiven_rounds) == (0, [], ["R"])


def test_a_report_after_the_loss_is_never_counted() -> None:
    out = elastic_step(FineTuneJobStatus(), [*SURVIVOR, LOST_POD], at(NODE_LOST + 2), None, reading({}))  # fmt: skip
    assert (out.status.forgiven_rounds, out.status.restarts) == (["R"], 0)
    out = elastic_step(out.status, SURVIVOR, at(NODE_LOST + 20), {"qs-worker-0": ["R"]})
    assert (out.status.restarts, out.status.restart_ledger) == (0, [])


def test_a_status_from_before_forgiven_rounds_still_skips_its_node_losses_rounds() -> None:
    old = FineTuneJobStatus(
        node_losses=[NodeLoss(pod="qs-worker-1", node="node-b", time="t", round="R")]
    )
    out = elastic_step(old, SURVIVOR, at(NODE_LOST + 20), {"qs-worker-0": ["R"]})
    assert (out.status.restarts, out.status.restart_ledger) == (0, [])


def test_a_budget_spent_only_by_the_node_is_given_back_and_the_job_runs_on() -> None:
    """maxRestarts 1, one genuine failure counted, then the survivors' timeout spends the last:
    restarts 2 > 1 would fail the job, unless the loss is known in the same pass."""
    spent = FineTuneJobStatus(restarts=1, restart_ledger=["G"])
    out = elastic_step(
        spent, [*SURVIVOR, LOST_POD], at(NODE_LOST + 2), {"qs-worker-0": ["G", "R"]},
        reading({}), max_restarts=1,
    )  # fmt: skip
    assert out.status.phase != "Failed" and out.status.restarts == 1
    # Without the loss known, the same report fails it: the test can fail.
    out = elastic_step(spent, SURVIVOR, at(12), {"qs-worker-0": ["G", "R"]}, max_restarts=1)
    assert out.status.phase == "Failed"


@pytest.mark.parametrize(
    ("view", "now", "held"),
    [
        (node(), at(12), True),  # the survivors' report, before the eviction
        (node(), at(NODE_LOST + HOLD_SLACK_SECONDS - 1), True),
        (node(), at(NODE_LOST + HOLD_SLACK_SECONDS), False),  # never judged lost: fail
        (node("True"), at(12), False),  # the node is back: the failure was real
        (node(since=None), at(12), False),  # a node that never posted: not judged
        (None, at(12), False),  # not read
    ],
    ids=["window", "window-end", "past-the-hold", "node-ready", "never-posted", "not-read"],
)
def test_the_budget_check_holds_while_a_workers_node_is_down(
    view: NodeView | None, now: datetime, held: bool
) -> None:
    r = NodeReading({"node-b": view} if view is not None else {})
    why = budget_hold([*SURVIVOR, NOT_YET], r, now, NODE_LOST)
    assert bool(why) is held
    assert not held or ("qs-worker-1" in why and "node-b" in why)


def test_a_budget_spent_before_the_loss_is_known_does_not_fail_the_job_in_the_window() -> None:
    spent = FineTuneJobStatus(restarts=1, restart_ledger=["G"])
    down = NodeReading({"node-b": node()})
    out = elastic_step(spent, [*SURVIVOR, NOT_YET], at(12), {"qs-worker-0": ["G", "R"]}, down,
                       max_restarts=1)  # fmt: skip
    assert out.status.phase != "Failed" and out.status.restarts == 2
    ready = find(out.status.conditions, COND_WORKERS_READY)
    assert ready is not None and "restart budget spent" in ready.message
    # Then the pod is judged lost: the round is taken back, the job runs on.
    out = elastic_step(out.status, [*SURVIVOR, LOST_POD], at(NODE_LOST + 2),
                       {"qs-worker-0": ["G", "R"]}, reading({"R": at(12)}), max_restarts=1)  # fmt: skip
    assert out.status.phase != "Failed" and out.status.restarts == 1
    assert [p["metadata"]["name"] for p in out.actions.create] == ["qs-worker-1"]
    # Or the node comes back instead: the failure was real, the job fails.
    back = NodeReading({"node-b": node("True")})
    out = elastic_step(spent, [*SURVIVOR, NOT_YET], at(12), {"qs-worker-0": ["G", "R"]}, back,
                       max_restarts=1)  # fmt: skip
    assert out.status.phase == "Failed"


def test_a_pod_judged_lost_again_takes_no_second_round_back() -> None:
    """Its force delete failed, or was not seen gone yet (the operator restarted: no memory of
    it): the next pass finds the same pod lost again. Its round unseen (rule 2), it already
    took back the first round counted since its node went down; the second such round is a
    failure of the survivors' own and stays counted."""
    down = NodeReading({"node-b": node()})
    out = elastic_step(FineTuneJobStatus(), [*SURVIVOR, NOT_YET], at(12),
                       {"qs-worker-0": ["X"]}, down)  # fmt: skip
    out = elastic_step(out.status, [*SURVIVOR, NOT_YET], at(30),
                       {"qs-worker-0": ["X", "Y"]}, down)  # fmt: skip
    assert (out.status.restarts, out.status.restart_ledger) == (2, ["X", "Y"])
    unseen = NodeReading({"node-b": node()}, counted_at={"X": at(12), "Y": at(30)})
    out = elastic_step(out.status, [*SURVIVOR, LOST_POD], at(NODE_LOST + 2),
                       {"qs-worker-0": ["X", "Y"]}, unseen)  # fmt: skip
    s = out.status
    assert (s.restarts, s.restart_ledger, s.forgiven_rounds) == (1, ["Y"], ["X"])
    out = elastic_step(s, [*SURVIVOR, LOST_POD], at(NODE_LOST + 12),
                       {"qs-worker-0": ["X", "Y"]}, unseen)  # fmt: skip
    s = out.status
    assert (s.restarts, s.restart_ledger, s.forgiven_rounds) == (1, ["Y"], ["X"])
    # A pod of the same name lost in a later outage of its node is another loss: the first
    # round counted since then (Z, this pass) is taken back.
    later = at(NODE_LOST + 500)
    again = terminating(uid="uid-qs-worker-1-b", deleted=later + timedelta(seconds=NODE_LOST))
    out = elastic_step(s, [*SURVIVOR, again], later + timedelta(seconds=NODE_LOST + 2),
                       {"qs-worker-0": ["X", "Y", "Z"]},
                       NodeReading({"node-b": node(since=later)}))  # fmt: skip
    s = out.status
    assert (s.restarts, s.restart_ledger, s.forgiven_rounds) == (1, ["Y"], ["X", "Z"])


def test_a_pass_that_counts_one_round_and_takes_another_back_says_both() -> None:
    """The survivor reports a genuine failure G in the pass that judges worker-1 lost and takes
    its round R back: status.restarts does not move, the metrics must still see both."""
    before = FineTuneJobStatus(restarts=1, restart_ledger=["R"])
    out = elastic_step(
        before, [*SURVIVOR, LOST_POD], at(NODE_LOST + 2), {"qs-worker-0": ["R", "G"]},
        reading({"R": at(12)}),
    )  # fmt: skip
    s = out.status
    assert (s.restarts, s.restart_ledger, s.forgiven_rounds) == (1, ["G"], ["R"])
    assert taken_back(before, s) == 1
    assert taken_back(s, s) == 0
