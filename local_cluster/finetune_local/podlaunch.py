"""What the local kubelet starts a pod's container with, and what it keeps of a started pod.

:func:`prepare_container` does what a kubelet does before the process: volumes set up
(:mod:`.podrunner`), environment resolved from the pod's ConfigMaps and Secrets
(:mod:`.podspec`, :mod:`.podsources`), the hosts file written, the mounts listed;
:func:`launch_spec` is what :mod:`.podinit` runs (and runs again on a restart).
"""

from __future__ import annotations

import asyncio
import functools
import pathlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from finetune_local import emptydir, podrunner
from finetune_local.imageenv import image_env
from finetune_local.mountpoints import MountPoints
from finetune_local.podsources import bind_claim, fetch_config, referenced_configs
from finetune_local.podspec import container_env, expand, secret_data
from finetune_local.restclient import RestClient
from finetune_local.termination import termination_mount

if TYPE_CHECKING:
    from finetune_local.kubeletconfig import KubeletConfig

HostsRenderer = Callable[[Mapping[str, Any], str], str]


@dataclass
class PodRun:
    """A started pod: its process, address and files."""

    uid: str
    ip: str
    directory: pathlib.Path
    container: str
    hosts_file: pathlib.Path
    key: tuple[str, str] = ("", "")  # the pod's namespace and name
    node: str = ""
    process: asyncio.subprocess.Process | None = None
    started_at: str = ""
    restart_count: int = 0
    log_start: int = 0  # where the current container instance's output begins in the log
    terminating: bool = False
    finished: bool = False
    hosts_text: str = ""
    launch: dict[str, Any] = field(default_factory=dict)  # podinit spec, reused on restarts
    env: dict[str, str] = field(default_factory=dict)
    size_limits: list[emptydir.SizeLimit] = field(default_factory=list)
    usage_checked_at: float = 0.0
    evicted: str = ""  # the eviction message, once evicted
    grace: float = 30.0  # its spec's terminationGracePeriodSeconds
    # Back from a partition with its object gone (nodefaults.restore): stopped gracefully.
    stale: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else 0

    @property
    def log_path(self) -> pathlib.Path:
        return self.directory / f"{self.container}.log"

    @property
    def termination_file(self) -> pathlib.Path:
        return self.directory / f"{self.container}.termination-log"


async def prepare_container(
    client: RestClient,
    config: KubeletConfig,
    pod: dict[str, Any],
    container: dict[str, Any],
    run: PodRun,
    mountpoints: MountPoints,
    hosts_for: HostsRenderer,
) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """The container's environment and mounts, its volumes and hosts file in place.

    Raises ConfigMissingError (ContainerConfigError for env) while a ConfigMap, Secret, key
    or claim the pod names is not there yet."""
    namespace = pod["metadata"].get("namespace", "")
    volumes = await podrunner.materialise_volumes(
        pod,
        run.directory,
        config.data_dir,
        functools.partial(fetch_config, client),
        functools.partial(bind_claim, client, config.data_dir),
    )
    lookups: dict[tuple[str, str], dict[str, str] | None] = {}
    for kind, name in referenced_configs(container):
        obj = await fetch_config(client, kind, namespace, name)
        lookups[(kind, name)] = (
            None
            if obj is None
            else (secret_data(obj) if kind == "secret" else dict(obj.get("data") or {}))
        )
    pod_view = {
        **pod,
        "status": {**pod.get("status", {}), "podIP": run.ip, "hostIP": "127.0.0.1"},
    }
    env = container_env(
        pod_view, container, lambda k, n: lookups.get((k, n)), image_env(pod, config)
    )
    run.directory.mkdir(parents=True, exist_ok=True)
    run.hosts_text = hosts_for(pod_view, run.ip)
    run.hosts_file.write_text(run.hosts_text)
    mounts = podrunner.container_mounts(container, volumes, run.hosts_file, mountpoints)
    mounts.append(termination_mount(container, run.termination_file))
    mountpoints.ensure(pathlib.Path(mounts[-1]["target"]), is_file=True)
    return env, mounts


def launch_spec(
    container: Mapping[str, Any],
    env: Mapping[str, str],
    mounts: list[dict[str, Any]],
    data_dir: pathlib.Path,
) -> dict[str, Any]:
    """What podinit runs: the command with $(VAR) expanded, in the container's working
    directory (created; without `workingDir`, the cluster's one shared directory)."""
    argv = [
        expand(str(a), env)
        for a in [*(container.get("command") or []), *(container.get("args") or [])]
    ]
    workdir = pathlib.Path(container.get("workingDir") or data_dir / "shared")
    workdir.mkdir(parents=True, exist_ok=True)
    return {
        "hostname": env["HOSTNAME"],
        "mounts": mounts,
        "workingDir": str(workdir),
        "argv": argv,
        "keepVisible": podrunner.image_paths(data_dir),
    }


def refresh_hosts_files(
    runs: Iterable[PodRun],
    pods: Mapping[tuple[str, str], Mapping[str, Any]],
    hosts_for: HostsRenderer,
) -> None:
    """Rewrite each running pod's hosts file in place (same inode: its bind mount follows)."""
    for run in runs:
        pod = pods.get(run.key)
        if pod is None or pod["metadata"].get("uid") != run.uid or run.finished:
            continue
        text = hosts_for(pod, run.ip)
        if text != run.hosts_text:
            with open(run.hosts_file, "r+") as handle:
                handle.write(text)
                handle.truncate()
            run.hosts_text = text


def is_current(run: PodRun, pods: Mapping[tuple[str, str], Mapping[str, Any]]) -> bool:
    """Whether the pod object of the run's name is still the run's (same uid): not one
    force-deleted and replaced by another of the same name."""
    pod = pods.get(run.key)
    return pod is not None and pod["metadata"]["uid"] == run.uid


def run_named(
    runs: Mapping[str, PodRun],
    pods: Mapping[tuple[str, str], Mapping[str, Any]],
    key: tuple[str, str],
) -> PodRun | None:
    """The run (`runs` by uid) of the pod of that name: the current object's, else the
    latest one's (a pod gone, its logs still asked for)."""
    pod = pods.get(key)
    if pod is not None and pod["metadata"]["uid"] in runs:
        return runs[pod["metadata"]["uid"]]
    named = [r for r in runs.values() if r.key == key]
    return named[-1] if named else None
