"""The lost-node drill on the local cluster, shared by the end-to-end test
(`test_node_loss.py`, which asserts on it) and `bench/recovery.py --part nodeloss` (which
prints it).

A 2-worker job of fixed size (it cannot train on without the lost worker, so the recovery
measured is the whole path; an elastic job trains on alone: `test_node_loss.py` runs that
variant for what it counts) has worker-1's node partitioned
(`LocalCluster.lose_node`: its pods frozen, its kubelet silent). What follows is Kubernetes':
the node goes Unknown and is tainted unreachable, worker-1 is evicted after its toleration
(`faultTolerance.nodeLostSeconds`) and stays Terminating, as no kubelet confirms it; then the
operator's: it force-deletes the pod and creates its replacement on another node; the
survivor's collective times out and it re-forms with the replacement, resuming from the
newest committed checkpoint.

Short settings so that it fits about a minute: a 4 s node monitor grace, 10 s
nodeLostSeconds and collective timeouts (the least each allows).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_local.controllermanager import NodeHealthTimings
from finetune_local.podrunner import pod_processes
from finetune_local.session import LocalSession
from finetune_operator.api.constants import GROUP, LABEL_JOB, PLURAL, VERSION
from tests.conftest import wait_until
from tests.e2e.faults import INTERVAL as INTERVAL_STEPS
from tests.e2e.faults import FaultRunner, Recovery, faults_job

__all__ = [
    "ELASTIC_JOB", "ELASTIC_NODE_LOST_SECONDS", "ELASTIC_STEPS", "INTERVAL_STEPS", "JOB", "lose_worker_node", "node_loss_job",
    "node_loss_session",
]  # fmt: skip
JOB = "ft-nodeloss"
STEPS = 20
# The elastic variant (minNodes 1): the survivor re-forms alone once its collective timed out
# and its rendezvous dropped the silent agent, and reports that round from its next group
# (about 30 s here); nodeLostSeconds longer than that, so that the report comes before the
# operator judges the pod lost (as with a cluster's defaults: a collective timeout of a
# minute, the monitor grace plus 60 s); enough steps that the job is still training then (the
# test ends there and deletes it).
ELASTIC_JOB = "ft-nodeloss-elastic"
ELASTIC_STEPS = 200
ELASTIC_NODE_LOST_SECONDS = 40
FAST_NODES = NodeHealthTimings(
    heartbeat_seconds=1,
    monitor_period_seconds=1,
    monitor_grace_seconds=4,
    eviction_period_seconds=1,
    pod_gc_period_seconds=5,
    pod_gc_quarantine_seconds=10,
)


def node_loss_session(data: Path) -> LocalSession:
    """3 nodes (the store, the survivor, the lost one; the replacement goes where the lost
    one was not), trainers slowed to 0.2 s a step, node health in seconds."""
    return LocalSession(
        data, nodes=3, extra_env={"FT_STEP_DELAY_SECONDS": "0.2"}, node_health=FAST_NODES
    )


def node_loss_job(
    doc: dict[str, Any], name: str = JOB, *, steps: int = STEPS, min_nodes: int = 2,
    node_lost_seconds: int = 10,
) -> dict[str, Any]:  # fmt: skip
    job = faults_job(doc, name, steps=steps)
    nodes = {"minNodes": min_nodes, "maxNodes": 2}
    job["spec"]["resources"] = {**job["spec"]["resources"], **nodes}
    job["spec"]["faultTolerance"] = {
        **job["spec"]["faultTolerance"],
        "nodeLostSeconds": node_lost_seconds,
        "collectiveTimeoutSeconds": 10,
        "startupCollectiveTimeoutSeconds": 10,
    }
    return job


@dataclass
class NodeLoss:
    recovery: Recovery
    node: str
    lost_pod: Any  # the V1Pod as it was before the loss
    frozen: list[int]  # its processes (agent, launcher, trainer)


def lose_worker_node(session: LocalSession, name: str = JOB) -> NodeLoss:
    """Wait until the job trains on both workers past a committed checkpoint, partition
    the node of a worker alone on it (worker-1's, as a rule), and wait until training goes past the step it had reached."""
    assert session.core is not None
    core = session.core
    runner = FaultRunner(session, name)
    runner.ready()
    pods = {
        p.metadata.name: p
        for p in core.list_namespaced_pod("default", label_selector=f"{LABEL_JOB}={name}").items
    }
    where = {n: p.spec.node_name for n, p in pods.items()}
    # The worker alone on its node (worker-1 where both are): losing a node that also holds
    # the store or the other worker is another drill.
    alone = [
        n for n in (f"{name}-worker-1", f"{name}-worker-0")
        if n in where and list(where.values()).count(where[n]) == 1
    ]  # fmt: skip
    assert alone, f"no worker alone on its node: {where}"
    lost_pod = pods[alone[0]]
    node = lost_pod.spec.node_name
    main = session.cluster.pod_main_pid("default", lost_pod.metadata.name)
    assert main is not None
    frozen = pod_processes(main)
    recovery = runner.inject(
        "node partitioned", lambda: session.cluster.lose_node(node, "partition"), timeout=180
    )
    return NodeLoss(recovery, node, lost_pod, frozen)


def remove_job(session: LocalSession, name: str) -> None:
    """Delete the job and wait until its pods are gone, so that the next drill's pods are
    spread over the nodes as on a fresh cluster (the scheduler scores by pod count: a
    terminating pod left behind can put both of its workers on one node)."""
    assert session.core is not None
    core = session.core
    session.custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name)

    def pods() -> list[str]:
        listed = core.list_namespaced_pod("default", label_selector=f"{LABEL_JOB}={name}")
        return [p.metadata.name for p in listed.items]

    wait_until(lambda: not pods(), f"job {name}'s pods gone", 120, detail=lambda: str(pods()))

    def tainted() -> list[str]:
        return [n.metadata.name for n in core.list_node().items if n.spec.taints]

    # A node restored by the drill keeps its unreachable taints until the node lifecycle
    # controller sees its heartbeats again: the next job must have every node to spread over.
    wait_until(lambda: not tainted(), "every node untainted", 60, detail=lambda: str(tainted()))
