"""The local kubelet (and scheduler): runs the pods of virtual nodes as local processes.

It is a client of the API like a real kubelet: it lists and watches pods, services and nodes,
binds pending pods to a node (:mod:`.binding`, :mod:`.scheduler`), starts each bound pod's container under
:mod:`.podinit` (own mount + UTS namespace, hostname, volumes, /etc/hosts), reports status
(Pending -> Running -> Succeeded/Failed with the exit code) and carries out graceful deletion:
SIGTERM to the process group, SIGKILL after the grace period, then the final delete.
Its parts: :mod:`.informer` (list + watch caches), :mod:`.nodes` (Node registration),
:mod:`.podsources` (ConfigMaps, Secrets and claims a pod uses), :mod:`.imageenv` (what stands
for the image's environment), :mod:`.podspec` (environment, hosts file), :mod:`.podrunner`
(volumes, the process), :mod:`.emptydir` (emptyDir lifetime, sizeLimit eviction),
:mod:`.podlaunch` (what a container starts with), :mod:`.podstatus` (status bodies),
:mod:`.nodefaults` (a node lost, and back: ``LocalCluster.lose_node``). Its heartbeats (each
node's Lease) are :func:`.nodes.heartbeat_forever`.

Deviations from a real kubelet: only the first container runs (init and sidecar containers are
ignored); images are ignored (the command runs with this Python environment); there is no
network namespace (pods share the host's ports: each binds its own loopback ``$POD_IP`` from
the cluster's claimed /16, see :mod:`.addresses`); cpu/memory limits and probes are not
enforced (a running pod is Ready). Pod processes die with the process that runs the cluster
(a parent-death signal, see :mod:`.podinit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import pathlib
import signal
from collections.abc import Mapping
from typing import Any

from finetune_local import emptydir, podrunner
from finetune_local.addresses import AddressPool
from finetune_local.binding import schedule_pod
from finetune_local.events import EventRecorder
from finetune_local.evictionmanager import enforce_size_limits
from finetune_local.informer import Cache, ObjectKey, list_and_watch, remember
from finetune_local.kubeletconfig import KubeletConfig
from finetune_local.mountpoints import MountPoints
from finetune_local.nodefaults import LossKind, NodeFaults, not_ready_yet_running, stop_forgotten
from finetune_local.nodes import heartbeat_forever, register_node
from finetune_local.podlaunch import (
    PodRun,
    is_current,
    launch_spec,
    prepare_container,
    refresh_hosts_files,
    run_named,
)
from finetune_local.podspec import ConfigMissingError, ContainerConfigError, render_hosts
from finetune_local.podstatus import now, running_status, terminated_status, waiting
from finetune_local.restclient import ApiStatusError, RestClient, resource_path
from finetune_local.termination import begin_instance, read_message

logger = logging.getLogger(__name__)
PodKey = ObjectKey


class Kubelet:
    def __init__(self, client: RestClient, config: KubeletConfig) -> None:
        self.client, self.config = client, config
        self.pods: Cache = {}
        self.services: Cache = {}
        self.nodes: Cache = {}
        self.events = EventRecorder(client)  # the scheduler's
        # By pod uid: a pod force-deleted from a lost node and its replacement (same name) are
        # two runs, one frozen or dead, the other starting elsewhere.
        self.runs: dict[str, PodRun] = {}
        self.mountpoints = MountPoints()
        self.addresses: AddressPool | None = None
        self._busy: set[str] = set()  # pods (uids) with a start/stop step in flight
        self.faults = NodeFaults()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._children: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await podrunner.probe_isolation(self.config.data_dir / "kubelet")
        self.addresses = AddressPool.claim(self.config.address_scope)
        for name in self.config.node_names:
            capacity = {**self.config.node_capacity, **self.config.node_resources.get(name, {})}
            await register_node(self.client, name, self.config.node_labels, capacity)
        for path, cache in (
            (resource_path("v1", "pods"), self.pods),
            (resource_path("v1", "services"), self.services),
            (resource_path("v1", "nodes"), self.nodes),
        ):
            self._tasks.append(
                asyncio.create_task(list_and_watch(self.client, path, cache, self._wake.set))
            )
        self._tasks.append(asyncio.create_task(self._reconcile_forever()))
        beats = heartbeat_forever(
            self.client, self.config.node_names, lambda name: self.nodes.get(("", name)),
            self.faults.lost, self.config.heartbeat_seconds,
        )  # fmt: skip
        self._tasks.append(asyncio.create_task(beats))

    async def stop(self) -> None:
        for task in [*self._tasks, *self._children]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._children, return_exceptions=True)
        await self.faults.close()  # before the kills below: its pids are killed there
        for run in self.runs.values():
            if run.process is not None and run.process.returncode is None:
                await podrunner.kill_pod_processes(run.process.pid, 10)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(run.process.wait(), 5)
        self.mountpoints.remove_created()
        if self.addresses is not None:
            self.addresses.release()

    def kill_processes(
        self, namespace: str, name: str, sig: signal.Signals = signal.SIGKILL
    ) -> bool:
        """Signal the pod's process group without deleting the pod (SIGKILL: it fails with exit
        code 137; SIGTERM: what a node shutdown or spot reclaim does to its containers)."""
        run = run_named(self.runs, self.pods, (namespace, name))
        if run is None or run.process is None or run.process.returncode is not None:
            return False
        return podrunner.signal_group(run.process.pid, sig)

    async def lose_node(self, node: str, how: LossKind) -> None:
        """The node stops heartbeating, posting status and acting on deletions; its pods'
        processes are frozen (`partition`) or killed (`poweroff`): :mod:`.nodefaults`."""
        if node not in self.config.node_names:
            raise ValueError(f"no node {node!r} (nodes are {self.config.node_names})")
        await self.faults.lose(node, how, self.runs)

    async def restore_node(self, node: str) -> None:
        """The node is back: heartbeats resume (its Ready condition is posted again), pods
        whose objects are gone are killed, the others thawed and their status posted."""
        current = functools.partial(is_current, pods=self.pods)
        for uid in await self.faults.restore(node, self.runs, current):
            run = self.runs[uid]
            await self._post_back(run, self.pods[run.key])
            if run.finished and run.terminating:
                await self._final_delete(run.key, uid)  # it ended while the node was away
        self._wake.set()

    async def _post_back(self, run: PodRun, pod: dict[str, Any]) -> None:
        status = self.faults.status_when_back(run, pod)
        if status is not None:
            await self._patch_status(run.key, run.uid, status)

    def main_pid(self, namespace: str, name: str) -> int | None:
        """The pid of the pod's container process (its command), while it runs."""
        run = run_named(self.runs, self.pods, (namespace, name))
        alive = run is not None and run.process is not None and run.process.returncode is None
        return run.pid if alive and run is not None else None

    def log_path(self, namespace: str, name: str, container: str | None = None) -> pathlib.Path | None:  # fmt: skip
        run = run_named(self.runs, self.pods, (namespace, name))
        return None if run is None else run.directory / f"{container or run.container}.log"

    async def _reconcile_forever(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self._reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("local kubelet reconcile failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)

    async def _reconcile(self) -> None:
        # A lost node's part of the kubelet does nothing (nodefaults.py): it neither sees
        # deletions nor starts pods; the scheduler (the control plane's) goes on.
        ours = {n for n in self.config.node_names if not self.faults.is_lost(n)}
        # Force-deleted (grace 0): the object is gone, or another pod of that name now.
        for uid in [u for u, r in self.runs.items() if r.node in ours and not is_current(r, self.pods)]:  # fmt: skip
            self._forget(uid)
        for key, pod in list(self.pods.items()):
            meta = pod["metadata"]
            uid, run = meta["uid"], self.runs.get(meta["uid"])
            if uid in self._busy:
                continue
            node = pod.get("spec", {}).get("nodeName")
            if meta.get("deletionTimestamp"):
                if node in ours:
                    self._spawn_step(uid, key, self._terminate(key, pod))
            elif not node:
                await self._schedule(pod)
            elif node in ours and run is None and pod.get("status", {}).get("phase") == "Pending":
                self._spawn_step(uid, key, self._start(key, pod))
            elif node in ours and run is not None and not_ready_yet_running(pod, run):
                # The status manager's sync: marked not Ready while its node was away.
                self._spawn_step(uid, key, self._post_back(run, pod))
        live = {u: r for u, r in self.runs.items() if not self.faults.is_lost(r.node)}
        refresh_hosts_files(live.values(), self.pods, self._hosts_for)
        enforce_size_limits(live.values(), self._spawn_child)
        await self.events.flush()

    def _spawn_step(self, uid: str, key: PodKey, step: Any) -> None:
        self._busy.add(uid)

        async def run() -> None:
            try:
                await step
            except ApiStatusError as exc:
                logger.debug("pod %s/%s: %s", *key, exc)
            except Exception:
                logger.exception("local kubelet: pod %s/%s", *key)
            finally:
                self._busy.discard(uid)
                self._wake.set()

        task = asyncio.create_task(run())
        self._children.add(task)
        task.add_done_callback(self._children.discard)

    def _forget(self, uid: str) -> None:
        # Every process of the pod, as a runtime kills a container's cgroup: one in a session
        # of its own (a trainer) outlives a signal to the group; then its volumes.
        self._spawn_child(stop_forgotten(self.runs.pop(uid)))

    async def _patch_status(self, key: PodKey, uid: str, status: dict[str, Any]) -> None:
        run, pod = self.runs.get(uid), self.pods.get(key, {})
        node = run.node if run is not None else pod.get("spec", {}).get("nodeName")
        if self.faults.is_lost(node):
            self.faults.unposted[uid] = status  # posted when the node is back, if still due
            return
        if pod and pod["metadata"]["uid"] != uid:
            return  # the pod it belongs to is gone: another of the same name now
        path = resource_path("v1", "pods", key[0], key[1], "status")
        with contextlib.suppress(ApiStatusError):
            remember(self.pods, await self.client.merge_patch(path, {"status": status}))

    async def _schedule(self, pod: dict[str, Any]) -> None:
        await schedule_pod(
            self.client,
            self.events,
            self.pods,
            list(self.nodes.values()),
            pod,
            self.config.gang_schedulers,
        )

    # ------------------------------------------------------------------ pods

    def _allocate_ip(self) -> str:
        assert self.addresses is not None, "the kubelet is not started"
        return self.addresses.allocate()

    async def _start(self, key: PodKey, pod: dict[str, Any]) -> None:
        containers = pod.get("spec", {}).get("containers") or [{}]
        container = containers[0]
        directory = podrunner.pod_dir(self.config.data_dir, pod)
        uid = pod["metadata"]["uid"]
        run = PodRun(
            uid=uid,
            key=key,
            ip=self._allocate_ip(),
            directory=directory,
            container=container.get("name", "main"),
            hosts_file=directory / "etc-hosts",
            node=pod.get("spec", {}).get("nodeName") or "",
            grace=float(pod.get("spec", {}).get("terminationGracePeriodSeconds", 30)),
        )
        try:
            env, mounts = await prepare_container(
                self.client, self.config, pod, container, run, self.mountpoints, self._hosts_for
            )
        except ConfigMissingError as exc:
            # Env that names a missing Secret/ConfigMap or key: CreateContainerConfigError;
            # a volume that cannot be set up yet: still ContainerCreating (as a real kubelet).
            reason = (
                "CreateContainerConfigError"
                if isinstance(exc, ContainerConfigError)
                else "ContainerCreating"
            )
            await self._patch_status(
                key, uid, {"containerStatuses": [waiting(container, reason, str(exc))]}
            )
            await asyncio.sleep(1.0)  # retried by the next reconcile, as a real kubelet does
            return
        if not container.get("command"):
            await self._finish(
                key, run, 127, "the local kubelet ignores images: the container needs a command"
            )
            return
        run.launch = launch_spec(container, env, mounts, self.config.data_dir)
        run.env = env
        run.size_limits = emptydir.size_limits(pod, directory)
        self.runs[uid] = run
        run.log_start = begin_instance(run.termination_file, run.log_path)
        run.process = await podrunner.spawn(
            run.launch, directory / "launch.json", env, run.log_path
        )
        run.started_at = now()
        await self._patch_status(
            key,
            uid,
            running_status(pod, run.ip, run.started_at, run.pid, run.restart_count, container),
        )
        self._spawn_child(self._watch_process(key, pod, container))

    def _spawn_child(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._children.add(task)
        task.add_done_callback(self._children.discard)

    async def _watch_process(
        self, key: PodKey, pod: dict[str, Any], container: dict[str, Any]
    ) -> None:
        uid = pod["metadata"]["uid"]
        run = self.runs[uid]
        assert run.process is not None
        code = podrunner.exit_code(await run.process.wait())
        policy = pod.get("spec", {}).get("restartPolicy", "Always")
        restart = policy == "Always" or (policy == "OnFailure" and code != 0)
        # A powered-off node restarts nothing (its pods' status waits for it to come back).
        if (
            restart
            and not run.terminating
            and not run.evicted
            and not self.faults.is_lost(run.node)
        ):
            run.restart_count += 1
            await asyncio.sleep(min(30.0, 2.0 ** (run.restart_count - 1)))  # crash-loop backoff
            if run.terminating or uid not in self.runs:
                await self._finish(key, run, code, "")
                return
            run.log_start = begin_instance(run.termination_file, run.log_path)  # a new container
            run.process = await podrunner.spawn(
                run.launch, run.directory / "launch.json", run.env, run.log_path
            )
            run.started_at = now()
            await self._patch_status(
                key,
                uid,
                running_status(pod, run.ip, run.started_at, run.pid, run.restart_count, container),
            )
            await self._watch_process(key, pod, container)
            return
        message = read_message(container, run.termination_file, run.log_path, code, run.log_start)
        await self._finish(key, run, code, message)

    async def _finish(self, key: PodKey, run: PodRun, code: int, message: str) -> None:
        run.finished = True
        self.runs.setdefault(run.uid, run)
        pod = self.pods.get(key, {})
        container = (pod.get("spec", {}).get("containers") or [{}])[0]
        status = terminated_status(
            container,
            ip=run.ip,
            pid=run.pid,
            restart_count=run.restart_count,
            started_at=run.started_at,
            code=code,
            message=message,
            evicted=run.evicted,
        )
        await self._patch_status(key, run.uid, status)
        if run.terminating and not self.faults.is_lost(run.node):
            await self._final_delete(key, run.uid)

    async def _terminate(self, key: PodKey, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        run = self.runs.get(uid)
        if run is None or run.finished or run.process is None:
            await self._final_delete(key, uid)
            return
        if run.terminating:
            return
        run.terminating = True
        grace = int(pod["metadata"].get("deletionGracePeriodSeconds") or 0)
        podrunner.signal_group(run.process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(run.process.wait()), grace)
        except TimeoutError:
            if self.faults.is_lost(run.node):
                run.terminating = False  # cut off mid-way: finished when the node is back
                return
            podrunner.signal_group(run.process.pid, signal.SIGKILL)
        # _watch_process reports the exit and makes the final delete.

    async def _final_delete(self, key: PodKey, uid: str) -> None:
        # That very pod (uid precondition): never a replacement of the same name.
        with contextlib.suppress(ApiStatusError):
            await self.client.delete(
                resource_path("v1", "pods", key[0], key[1]), grace_period_seconds=0, uid=uid
            )
        run = self.runs.pop(uid, None)
        if run is not None:
            emptydir.remove_pod_volumes(run.directory)

    # ------------------------------------------------------------------ /etc/hosts

    def _hosts_for(self, pod: Mapping[str, Any], ip: str) -> str:
        return render_hosts(pod, ip, list(self.services.values()), list(self.pods.values()))
