"""The kubelet's side of a lost node (``LocalCluster.lose_node``): what a node that lost power
or was cut off from the control plane does, and what it does when it comes back.

While a node is lost its part of the kubelet is silent: no Lease renewal (so the node
lifecycle controller marks it Unknown and taints it), no pod status posted (what it would
post is kept, and posted when it is back, if the pod still exists), no deletion acted on, no
pod started. Its pods' processes are:

- ``partition``: frozen (:mod:`.freezer`): alive, sockets open, silent to their peers;
- ``poweroff``: killed (SIGKILL, every process of the tree). Unlike a real power loss, the
  kernel of this one host closes their sockets, so their peers see the connections close
  at once instead of timing out; ``partition`` is the silent loss.

Restored, every frozen process is thawed (on a real node they ran on all along) and the
kubelet reconciles as a real one does when it reaches the API server again: its informer's
relist finds the objects of some pods gone (force-deleted, or deleted by PodGC) and hands
each over as it last saw it, running, so the pod is stopped with its spec's
``terminationGracePeriodSeconds`` (the kubelet's pod workers' own default), not at once:
SIGTERM, that long to exit, then SIGKILL (:func:`stop_forgotten`). Until it exits it is a
live stale incarnation of its slot beside the replacement, as on a cluster: its agent may
reach the rendezvous store, its rank 0 the checkpoint root (whose fencing is what keeps it
out). The others are thawed and their status posted (terminating ones are then finished by
the kubelet's usual pass).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from finetune_local import emptydir, freezer, podrunner
from finetune_local.podlaunch import PodRun
from finetune_local.podstatus import ready_status, running_status

LossKind = Literal["partition", "poweroff"]
LOSS_KINDS: tuple[LossKind, ...] = ("partition", "poweroff")


def not_ready_yet_running(pod: Mapping[str, Any], run: PodRun) -> bool:
    """The API shows a pod whose container runs as not Ready: the node lifecycle controller
    marked it while its node was away. The kubelet's status manager, which compares the
    status it would post with the API's, posts it again."""
    running = run.process is not None and run.process.returncode is None
    if not running or run.finished or run.terminating or pod["metadata"].get("deletionTimestamp"):
        return False
    return pod.get("status", {}).get("phase") == "Running" and ready_status(pod) != "True"


@dataclass
class NodeFaults:
    lost: dict[str, LossKind] = field(default_factory=dict)
    frozen: dict[str, list[int]] = field(default_factory=dict)  # pids stopped, per pod uid
    keepers: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)  # per node
    unposted: dict[str, dict[str, Any]] = field(default_factory=dict)  # latest status, by uid

    def is_lost(self, node: str | None) -> bool:
        return bool(node) and node in self.lost

    async def lose(self, node: str, how: LossKind, runs: Mapping[str, PodRun]) -> None:
        if how not in LOSS_KINDS:
            raise ValueError(f"how must be one of {LOSS_KINDS}, not {how!r}")
        if node in self.lost:
            return
        self.lost[node] = how
        alive = [
            (uid, run)
            for uid, run in runs.items()
            if run.node == node and run.process is not None and run.process.returncode is None
        ]
        if how == "poweroff":
            await asyncio.gather(*(podrunner.kill_pod_processes(run.pid, 10) for _, run in alive))
            return
        for uid, run in alive:
            self.frozen[uid] = freezer.freeze(run.pid)
        pids = [pid for uid, _ in alive for pid in self.frozen[uid]]
        if pids:
            self.keepers[node] = await freezer.start_keeper(pids)

    async def restore(
        self, node: str, runs: Mapping[str, PodRun], current: Callable[[PodRun], bool]
    ) -> list[str]:
        """Bring `node` back: its frozen pods thawed. Those whose objects are gone (`current`:
        the object of the pod's name is still this pod's) are marked stale: the kubelet's
        next pass forgets them (:func:`stop_forgotten`). Returns the uids of the others,
        whose status the kubelet posts."""
        if node not in self.lost:
            return []
        # The node stays lost until its pods are dealt with: the kubelet's pass (which runs
        # at every await here) must not take them meanwhile.
        keeper = self.keepers.pop(node, None)
        if keeper is not None:
            await freezer.stop_keeper(keeper)  # before any pid it holds can die and be reused
        back: list[str] = []
        for uid, run in list(runs.items()):
            if run.node != node:
                continue
            freezer.thaw(self.frozen.pop(uid, []))
            if current(run):
                back.append(uid)
            else:
                self.unposted.pop(uid, None)
                run.stale = True
        del self.lost[node]
        return back

    def status_when_back(self, run: PodRun, pod: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """What the kubelet posts for a pod of a node that is back: the status it kept, or,
        for a pod that ran on (frozen, then thawed), its running status: Ready again (the node
        lifecycle controller had marked it not Ready)."""
        status = self.unposted.pop(run.uid, None)
        if status is None and pod is not None and not run.finished:
            container = (pod.get("spec", {}).get("containers") or [{}])[0]
            status = running_status(
                pod, run.ip, run.started_at, run.pid, run.restart_count, container
            )
        return status

    async def close(self) -> None:
        """Dismiss every keeper (the kubelet is stopping: it kills the pods itself)."""
        for keeper in self.keepers.values():
            await freezer.stop_keeper(keeper)
        self.keepers.clear()


async def stop_forgotten(run: PodRun) -> None:
    """Stop a pod the kubelet forgets (its object gone, or another pod's now), then delete its
    volumes. One it saw force-deleted saw `deletionGracePeriodSeconds: 0`, which a kubelet
    makes 1 s: killed at once. A stale one (back from a partition, last seen running) gets
    SIGTERM and its spec's grace period to exit first, as a kubelet gives it."""
    alive = run.process is not None and run.process.returncode is None
    tree = podrunner.pod_processes(run.pid) if alive else []
    try:
        if alive and run.stale and run.process is not None:
            run.terminating = True  # no restart of what exits now
            podrunner.signal_group(run.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(run.process.wait()), run.grace)
    finally:
        # Even when the kubelet stops mid-grace (cancelled): nothing of it outlives it.
        if alive:
            await asyncio.shield(podrunner.kill_pod_processes(run.pid, 10, also=tree))
        emptydir.remove_pod_volumes(run.directory)
