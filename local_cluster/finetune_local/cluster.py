"""``LocalCluster``: an API emulator, virtual nodes and a local kubelet in one process tree.

Usage (synchronous; the cluster runs in a background thread with its own event loop, so kopf
or a test can run in the calling thread, or in its own asyncio loop, without sharing one)::

    with LocalCluster(nodes=2) as cluster:          # or: await cluster.astart() / astop()
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig_path)
        subprocess.run(["kubectl", "get", "ftj"])   # kubectl, kubernetes client, kopf...
        cluster.kill_pod_processes("default", "job-worker-0")   # exit 137, pod Failed
        cluster.lose_node("local-node-1")   # partitioned: Unknown, tainted, its pods evicted

For kopf in the same process, log in explicitly (kopf would otherwise read ~/.kube/config)::

    @kopf.on.login()
    def login(**_): return kopf.ConnectionInfo(server=cluster.api_url, insecure=True)

The CRDs of ``crds_dir`` (the repo's ``crds/`` by default) are registered before the server
answers its first request. ``stop()`` kills every pod process group and waits for them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import pathlib
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Collection, Coroutine
from types import TracebackType
from typing import Any, Self, TypeVar

import kmock
import yaml

from finetune_local.apiserver import ApiServer
from finetune_local.controllermanager import ControllerManager, NodeHealthTimings
from finetune_local.kubeconfig import write_kubeconfig
from finetune_local.kubelet import Kubelet
from finetune_local.kubeletconfig import KubeletConfig
from finetune_local.kueue import kueue_crds
from finetune_local.nodefaults import LossKind
from finetune_local.nodes import DEFAULT_CAPACITY, check_node_resources
from finetune_local.podgroups import GANG_SCHEDULERS
from finetune_local.restclient import RestClient

T = TypeVar("T")
REPO_CRDS = pathlib.Path(__file__).resolve().parents[2] / "crds"


class LocalCluster:
    """A local Kubernetes-like cluster. See the module docstring for usage.

    :param data_dir: where logs, volumes, PVCs (``pvcs/<ns>/<claim>``), the shared working
        directory (``shared/``) and the kubeconfig live; a temporary directory (removed at stop
        unless ``keep_data``) when None.
    :param nodes: how many virtual nodes (``local-node-0`` ... ``local-node-<n-1>``).
    :param crds_dir: directory of CRD YAML files to register; None registers none.
    :param node_labels: extra labels on every node.
    :param node_capacity: capacity of every node over the default
        (:data:`.nodes.DEFAULT_CAPACITY`: 8 cpu, 32Gi memory, 200Gi ephemeral-storage, 110
        pods), e.g. ``{"nvidia.com/gpu": "1"}``; allocatable is capacity less the kubelet's
        default hard-eviction thresholds (:func:`.nodes.node_allocatable`).
    :param node_resources: per node name, capacity over ``node_capacity`` for that node only
        (e.g. one GPU node among CPU ones).
    :param extra_env: environment added to every pod's processes.
    :param node_env: per node name, environment added to the processes of the pods it runs: a
        stand-in for that node's hardware (e.g. a slow GPU), so a pod rescheduled elsewhere
        behaves normally.
    :param kubelet: False runs the API server alone (no nodes, pods stay Pending).
    :param gang_schedulers: gang schedulers installed beside the default one
        (``coscheduling``, ``volcano``: :mod:`.podgroups`): their PodGroup CRD is registered and
        their pods are placed all-or-nothing. Without one, its PodGroups do not exist (404).
    :param kueue: serve Kueue's Workload and ResourceFlavor CRDs (:mod:`.kueue`), as a
        cluster with Kueue installed; nothing admits Workloads (a test plays Kueue's part).
    :param node_health: the heartbeat and the node lifecycle, taint eviction and PodGC
        controllers' timings (:class:`.controllermanager.NodeHealthTimings`: Kubernetes'
        defaults unless given).
    :param controllers: run those controllers (default: when the kubelet runs).
    """

    def __init__(
        self,
        data_dir: str | pathlib.Path | None = None,
        *,
        nodes: int = 2,
        crds_dir: str | pathlib.Path | None = REPO_CRDS,
        node_labels: dict[str, str] | None = None,
        node_capacity: dict[str, str] | None = None,
        node_resources: dict[str, dict[str, str]] | None = None,
        extra_env: dict[str, str] | None = None,
        kubelet: bool = True,
        keep_data: bool = False,
        node_env: dict[str, dict[str, str]] | None = None,
        gang_schedulers: Collection[str] = (),
        kueue: bool = False,
        node_health: NodeHealthTimings | None = None,
        controllers: bool | None = None,
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = pathlib.Path(data_dir or tempfile.mkdtemp(prefix="ftjob-local-")).resolve()
        self.kubeconfig_path = self.data_dir / "kubeconfig"
        self.node_names = [f"local-node-{i}" for i in range(nodes)]
        self._crds_dir = pathlib.Path(crds_dir) if crds_dir else None
        self._node_labels, self._extra_env = dict(node_labels or {}), dict(extra_env or {})
        self._node_env = {node: dict(env) for node, env in (node_env or {}).items()}
        self._capacity = {**DEFAULT_CAPACITY, **(node_capacity or {})}
        self._node_resources = {n: dict(c) for n, c in (node_resources or {}).items()}
        check_node_resources(self.node_names, self._capacity, self._node_resources)
        self._with_kubelet, self._keep_data = kubelet, keep_data
        self._gangs = [GANG_SCHEDULERS[name] for name in gang_schedulers]
        self._kueue = kueue
        self._timings = node_health or NodeHealthTimings()
        self._with_controllers = kubelet if controllers is None else controllers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._api: ApiServer | None = None
        self._kubelet: Kubelet | None = None
        self.api_url = ""

    # ------------------------------------------------------------------ public API

    @property
    def api(self) -> ApiServer:
        """The emulator itself (its ``store``/``objects`` for in-process assertions)."""
        assert self._api is not None, "the cluster is not started"
        return self._api

    def start(self) -> Self:
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(started,), name="local-cluster", daemon=True
        )
        self._thread.start()
        started.result()  # re-raises a startup failure (e.g. no namespaces) here
        return self

    def stop(self) -> None:
        """Kill all pod processes, stop the server, remove a temporary data dir."""
        if self._loop is not None and self._stopping is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout=60)
        self._loop = self._thread = None
        if self._own_dir and not self._keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill_pod_processes(
        self, namespace: str, name: str, sig: signal.Signals = signal.SIGKILL
    ) -> bool:
        """Signal a pod's processes without deleting the pod (SIGKILL: it goes Failed, exit code
        137; SIGTERM: a node shutting down or a spot instance reclaimed)."""
        return self.call(
            lambda: self._kubelet.kill_processes(namespace, name, sig) if self._kubelet else False
        )

    def lose_node(self, name: str, how: LossKind = "partition") -> None:
        """Lose a node: it stops heartbeating, posting its pods' status and acting on their
        deletions; its pods' processes are frozen (``partition``: alive, silent, sockets
        open) or killed (``poweroff``). The control plane goes on: after the monitor grace
        the node is Unknown and tainted, its pods not Ready, then evicted as their
        tolerations say (:mod:`.nodefaults`, :mod:`.nodelifecycle`, :mod:`.tainteviction`)."""
        assert self._kubelet is not None, "the cluster runs no kubelet"
        self.run(self._kubelet.lose_node(name, how))

    def restore_node(self, name: str) -> None:
        """The node is back: heartbeats resume, pods deleted meanwhile are killed, the others
        thawed and reported again, terminating ones finished."""
        assert self._kubelet is not None, "the cluster runs no kubelet"
        self.run(self._kubelet.restore_node(name))

    def pod_main_pid(self, namespace: str, name: str) -> int | None:
        """The pid of a running pod's container process (None when it is not running)."""
        return self.call(lambda: self._kubelet.main_pid(namespace, name) if self._kubelet else None)

    def pod_log_path(
        self, namespace: str, name: str, container: str | None = None
    ) -> pathlib.Path | None:
        """The file holding the pod container's stdout+stderr (None if it never started)."""
        return self.call(
            lambda: self._kubelet.log_path(namespace, name, container) if self._kubelet else None
        )

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the cluster's event loop thread (the emulator is not thread-safe)."""

        async def wrapper() -> T:
            return fn()

        return self.run(wrapper())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the cluster's event loop and wait for its result."""
        assert self._loop is not None, "the cluster is not started"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def astart(self) -> Self:
        return await asyncio.to_thread(self.start)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    async def __aenter__(self) -> Self:
        return await self.astart()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.astop()

    # ------------------------------------------------------------------ the loop thread

    def _thread_main(self, started: concurrent.futures.Future[None]) -> None:
        try:
            asyncio.run(self._serve(started))
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)

    async def _serve(self, started: concurrent.futures.Future[None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "shared").mkdir(exist_ok=True)
        api = ApiServer(
            log_reader=lambda ns, name, c: (
                self._kubelet.log_path(ns, name, c) if self._kubelet else None
            )
        )
        self._register_crds(api)
        async with api, kmock.Server(api, host="127.0.0.1") as server:
            self._api = api
            self.api_url = f"http://127.0.0.1:{server.port}"
            write_kubeconfig(self.kubeconfig_path, self.api_url)
            async with RestClient(self.api_url) as client:
                if self._with_kubelet:
                    self._kubelet = Kubelet(
                        client,
                        KubeletConfig(
                            data_dir=self.data_dir,
                            api_url=self.api_url,
                            node_names=self.node_names,
                            node_labels=self._node_labels,
                            node_capacity=self._capacity,
                            node_resources=self._node_resources,
                            extra_env=self._extra_env,
                            node_env=self._node_env,
                            gang_schedulers=self._gangs,
                            heartbeat_seconds=self._timings.heartbeat_seconds,
                        ),
                    )
                    await self._kubelet.start()
                manager = ControllerManager(client, self._timings)
                if self._with_controllers:
                    manager.start()
                started.set_result(None)
                try:
                    await self._stopping.wait()
                finally:
                    await manager.stop()
                    if self._kubelet is not None:
                        await self._kubelet.stop()

    def _register_crds(self, api: ApiServer) -> None:
        crd_type = api.registry.get("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        assert crd_type is not None
        for gang in self._gangs:
            api.service.create(crd_type, None, gang.crd())
        for crd in kueue_crds() if self._kueue else []:
            api.service.create(crd_type, None, crd)
        if self._crds_dir is None or not self._crds_dir.is_dir():
            return
        for path in sorted(self._crds_dir.glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                    api.service.create(crd_type, None, doc)
