"""The lost-node drill (`tests/e2e/nodeloss.py`): worker-1's node of a fixed-size 2-worker job
partitioned; the control plane marks it Unknown and evicts the pod, which stays Terminating;
the operator force-deletes it, its replacement starts on another node, the survivor re-forms
with it from the newest committed checkpoint, and the job Succeeds. A node loss is a
preemption: `status.preemptions`, never `status.restarts` (the survivor's collective timeout
is in the round the lost pod was training in). Then the node comes back and its kubelet kills
the frozen pod, whose object is gone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from finetune_local.session import LocalSession, is_finished, phase_of
from finetune_operator.api.constants import GROUP, PLURAL, VERSION
from tests.conftest import wait_until
from tests.e2e.nodeloss import (
    INTERVAL_STEPS,
    JOB,
    lose_worker_node,
    node_loss_job,
    node_loss_session,
)
from tests.e2e.processes import cluster_processes

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    with node_loss_session(tmp_path_factory.mktemp("nodeloss") / "cluster") as session:
        yield session


@pytest.mark.timeout(300)
def test_a_lost_node_is_recovered_from_without_spending_the_restart_budget(
    session: LocalSession, quickstart_doc: dict[str, Any]
) -> None:
    assert session.core is not None
    core = session.core
    session.submit(node_loss_job(quickstart_doc))
    loss = lose_worker_node(session)
    r, node, lost = loss.recovery, loss.node, loss.lost_pod
    print(f"\nlost node {node}: training steps again {r.seconds:.1f} s after the loss")
    assert r.resumed_from is not None and 0 < r.resumed_from <= r.step_at_fault
    assert r.step_at_fault - r.resumed_from <= INTERVAL_STEPS + 1

    replacement = core.read_namespaced_pod(lost.metadata.name, "default")
    assert replacement.metadata.uid != lost.metadata.uid
    assert replacement.spec.node_name != node
    events = [
        e
        for e in core.list_namespaced_event("default").items
        if e.reason == "NodeLost" and e.involved_object.name == JOB
    ]
    (event,) = events
    assert event.type == "Warning" and lost.metadata.name in event.message and node in event.message

    job = session.wait_for(JOB, is_finished, timeout=180)
    status = job["status"]
    assert phase_of(job) == "Succeeded", status
    assert status["preemptions"] >= 1 and status["restarts"] == 0, status
    (record,) = status["nodeLosses"]
    assert (record["pod"], record["node"]) == (lost.metadata.name, node), record
    assert record.get("round"), record  # the round the survivor's timeout was not counted in

    # The node comes back: its kubelet kills the frozen pod (its object is gone), and the
    # node is Ready and untainted again.
    session.cluster.restore_node(node)

    def healthy() -> bool:
        n = core.read_node(node)
        ready = next(c.status for c in n.status.conditions if c.type == "Ready")
        return ready == "True" and not n.spec.taints

    wait_until(healthy, f"node {node} Ready and untainted", 30)

    def still_alive() -> set[int]:
        return set(cluster_processes(session.data_dir)).intersection(loss.frozen)

    wait_until(lambda: not still_alive(), "the lost pod's processes killed", 30,
               detail=lambda: str(still_alive()))  # fmt: skip
    session.custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, JOB)
