"""A local cluster with the real operator running beside it: what `ftjob run --local` and the
end-to-end tests drive. The operator runs in its own thread and event loop, exactly as
`ftjob operator` runs it in a pod, logged in through the cluster's kubeconfig."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, cast

from kubernetes import client, config

from finetune_local.cluster import LocalCluster
from finetune_local.controllermanager import NodeHealthTimings
from finetune_local.kueue import GROUP as KUEUE_GROUP
from finetune_operator.api.constants import GROUP, PLURAL, VERSION
from finetune_operator.settings import parse_operator_args

JobObject = dict[str, Any]


def default_data_dir() -> Path:
    """A fresh directory for the cluster's state, deliberately *not* under /tmp: worker pods
    mount an emptyDir over /tmp (read-only root filesystem), which would hide it from them."""
    base = Path(os.environ.get("FTJOB_LOCAL_DIR", Path.cwd() / ".ftjob"))
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="run-", dir=base))


# The operator flags of the local cluster, on top of the chart's defaults: a pass every 2 s
# keeps `ftjob run --local`'s progress display and the end-to-end tests responsive.
LOCAL_OPERATOR_ARGS: tuple[str, ...] = ("--standalone", "--reconcile-interval=2",
                                        "--scrape-timeout=1", "--metrics-port=0")  # fmt: skip


class WithoutKueueFilter(logging.Filter):
    """Drops kopf's "Unresolved resources cannot be served (try creating their CRDs)" warning
    when it names only Kueue's resources: the local cluster serves Kueue's CRDs only when a test
    asks for them, so every `ftjob run --local` printed it in the middle of its progress lines,
    about a feature the job does not use. Any other unresolved resource is still warned of."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("Unresolved resources cannot be served"):
            return True
        groups = set(re.findall(r"group='([^']*)'", message))
        return groups != {KUEUE_GROUP}


def _quiet_kopf() -> None:
    # Expected here: signals belong to the main thread (the session's owner handles them).
    logging.getLogger("kopf._core.reactor.running").setLevel(logging.ERROR)
    observation = logging.getLogger("kopf._core.reactor.observation")
    if not any(isinstance(f, WithoutKueueFilter) for f in observation.filters):
        observation.addFilter(WithoutKueueFilter())


class OperatorThread:
    """The kopf operator (finetune_operator.handlers.operate) on a thread of its own, with
    settings parsed from `ftjob operator` flags exactly as the chart's Deployment passes them."""

    def __init__(self, kubeconfig: Path, namespaces: Collection[str] | None,
                 operator_args: Sequence[str] = ()) -> None:  # fmt: skip
        self._kubeconfig = str(kubeconfig)
        ns_args = [f"--namespace={n}" for n in namespaces] if namespaces else ["--all-namespaces"]
        self.settings = parse_operator_args([*ns_args, *LOCAL_OPERATOR_ARGS, *operator_args])
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="operator", daemon=True)

    def _main(self) -> None:
        from finetune_operator.handlers import operate

        _quiet_kopf()
        try:
            asyncio.run(
                operate(
                    self.settings,
                    kubeconfig=self._kubeconfig,
                    ready_flag=self._ready,
                    stop_flag=self._stop,
                )
            )
        except BaseException as exc:  # surfaced by start()/stop()
            self._error = exc
            self._ready.set()

    def start(self, timeout: float = 180.0) -> None:
        # Generous: importing kopf, kubernetes and the planner takes long on a loaded machine.
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the operator did not become ready")
        if self._error is not None:
            raise RuntimeError(f"the operator failed to start: {self._error}") from self._error

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


class LocalSession:
    """Cluster + operator; submit FineTuneJobs and watch them.

    with LocalSession() as session:
        session.submit(manifest_dict)
        job = session.wait_for("quickstart", lambda job: phase(job) == "Succeeded")
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        nodes: int = 4,
        namespaces: Collection[str] = ("default",),
        keep_data: bool = True,
        extra_env: dict[str, str] | None = None,
        operator_args: Sequence[str] = (),
        node_env: dict[str, dict[str, str]] | None = None,
        metrics_port: int | None = None,
        gang_schedulers: Collection[str] = (),
        node_capacity: dict[str, str] | None = None,
        kueue: bool = False,
        node_labels: dict[str, str] | None = None,
        node_resources: dict[str, dict[str, str]] | None = None,
        node_health: NodeHealthTimings | None = None,
    ) -> None:
        # gang_schedulers: installed beside the default scheduler ("coscheduling", "volcano");
        # node_capacity: every node's capacity over the default (e.g. {"pods": "1"});
        # node_resources: per node name, its own capacity over that (LocalCluster says more);
        # kueue: Kueue's Workload/ResourceFlavor CRDs served; node_labels: on every node;
        # node_health: heartbeats and the node controllers' timings (tests that lose nodes).
        self.data_dir = Path(data_dir) if data_dir else default_data_dir()
        self.cluster = LocalCluster(
            self.data_dir, nodes=nodes, keep_data=keep_data, extra_env=extra_env, node_env=node_env,
            gang_schedulers=gang_schedulers, node_capacity=node_capacity, kueue=kueue,
            node_labels=node_labels, node_resources=node_resources, node_health=node_health,
        )  # fmt: skip
        self._namespaces = list(namespaces)
        # `ftjob operator` flags, as the chart renders them; metrics_port opens the operator's
        # /metrics (0, the local default, serves none: sessions side by side never collide).
        self._operator_args = [*operator_args] + (
            [f"--metrics-port={metrics_port}"] if metrics_port else []
        )
        self._operator: OperatorThread | None = None
        self._custom: client.CustomObjectsApi | None = None
        self.core: client.CoreV1Api | None = None

    def __enter__(self) -> Self:
        self.cluster.start()
        try:
            api_client = config.new_client_from_config(  # type: ignore[no-untyped-call]
                str(self.cluster.kubeconfig_path)
            )
            self._custom = client.CustomObjectsApi(api_client)
            self.core = client.CoreV1Api(api_client)
            self._operator = OperatorThread(
                self.cluster.kubeconfig_path, self._namespaces, self._operator_args
            )
            self._operator.start()
        except BaseException:
            self.cluster.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._operator is not None:
            self._operator.stop()
        self.cluster.stop()

    def stop_operator(self) -> None:
        """Stop the operator (the cluster and its pods go on), as a crashed operator pod."""
        if self._operator is not None:
            self._operator.stop()
            self._operator = None

    def restart_operator(self) -> None:
        """Stop the operator and start a fresh one (nothing carried over in memory), as a
        rolling upgrade or a crashed operator pod would."""
        self.stop_operator()
        self._operator = OperatorThread(
            self.cluster.kubeconfig_path, self._namespaces, self._operator_args
        )
        self._operator.start()

    @property
    def custom(self) -> client.CustomObjectsApi:
        assert self._custom is not None, "the session is not started"
        return self._custom

    def submit(self, manifest: JobObject) -> JobObject:
        """Create the FineTuneJob (raises kubernetes ApiException when the server refuses it)."""
        namespace = manifest.get("metadata", {}).get("namespace", "default")
        created = self.custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, manifest
        )
        return cast(JobObject, created)

    def get(self, name: str, namespace: str = "default") -> JobObject:
        job = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        return cast(JobObject, job)

    def wait_for(
        self,
        name: str,
        until: Callable[[JobObject], bool],
        *,
        namespace: str = "default",
        timeout: float = 600.0,
        interval: float = 0.5,
        on_poll: Callable[[JobObject], None] | None = None,
    ) -> JobObject:
        """Poll the job until `until(job)`; `on_poll` sees every observation (progress display)."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.get(name, namespace)
            if on_poll is not None:
                on_poll(job)
            if until(job):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"{namespace}/{name}: condition not reached in {timeout:.0f} s")
            time.sleep(interval)


def phase_of(job: JobObject) -> str:
    return str(job.get("status", {}).get("phase") or "")


def is_finished(job: JobObject) -> bool:
    return phase_of(job) in ("Succeeded", "Failed")
