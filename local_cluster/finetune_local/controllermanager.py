"""The part of kube-controller-manager the local cluster runs: the controllers that act on
nodes that stop answering (:mod:`.nodelifecycle`, :mod:`.tainteviction`, :mod:`.podgc`).

Each is a client of the API over HTTP, as the real ones are, so what they do is seen (and
raced) by the operator and the kubelet exactly as on a cluster. The workload controllers
(ReplicaSet, Job, ...) are not run: nothing the operator makes needs them, and ownerReference
garbage collection is the API server's own here (:mod:`.apideletion`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from finetune_local import nodelifecycle, podgc, tainteviction
from finetune_local.nodes import DEFAULT_HEARTBEAT_SECONDS
from finetune_local.restclient import RestClient


@dataclass(frozen=True)
class NodeHealthTimings:
    """How fast a lost node is found and its pods evicted: Kubernetes' defaults, except in
    tests that lose nodes (which set them to seconds).

    :param heartbeat_seconds: how often the kubelet renews each node's Lease (10 s).
    :param monitor_period_seconds: ``--node-monitor-period`` (5 s).
    :param monitor_grace_seconds: ``--node-monitor-grace-period``: a node silent this long is
        Unknown and tainted (50 s since Kubernetes 1.32).
    :param eviction_period_seconds: how often the taint eviction controller looks (Kubernetes'
        is event-driven: its timers fire at the second).
    :param pod_gc_period_seconds: PodGC's period (20 s).
    :param pod_gc_quarantine_seconds: how long a node must be absent before PodGC deletes its
        pods (40 s).
    """

    heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS
    monitor_period_seconds: float = nodelifecycle.DEFAULT_PERIOD_SECONDS
    monitor_grace_seconds: float = nodelifecycle.DEFAULT_GRACE_SECONDS
    eviction_period_seconds: float = tainteviction.DEFAULT_PERIOD_SECONDS
    pod_gc_period_seconds: float = podgc.DEFAULT_PERIOD_SECONDS
    pod_gc_quarantine_seconds: float = podgc.DEFAULT_QUARANTINE_SECONDS

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"NodeHealthTimings.{name} must be above 0, not {value!r}")
        if self.monitor_grace_seconds <= self.heartbeat_seconds:
            raise ValueError(
                f"NodeHealthTimings.monitor_grace_seconds ({self.monitor_grace_seconds}) must "
                f"be above heartbeat_seconds ({self.heartbeat_seconds}): every node would be "
                "marked Unknown between two heartbeats"
            )


class ControllerManager:
    def __init__(self, client: RestClient, timings: NodeHealthTimings) -> None:
        self.node_lifecycle = nodelifecycle.NodeLifecycleController(
            client, timings.monitor_grace_seconds, timings.monitor_period_seconds
        )
        self.taint_eviction = tainteviction.TaintEvictionController(
            client, timings.eviction_period_seconds
        )
        self.pod_gc = podgc.PodGC(
            client, timings.pod_gc_period_seconds, timings.pod_gc_quarantine_seconds
        )
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for loop in (
            self.node_lifecycle.run_forever(),
            self.taint_eviction.run_forever(),
            self.pod_gc.run_forever(),
        ):
            self._tasks.append(asyncio.create_task(loop))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
