"""Starting and stopping a pod's container as a local process tree.

Each pod gets a directory ``<data>/pods/<ns>/<name>-<uid8>/`` holding its volumes, its hosts
file, its launcher spec and its logs (``<container>.log``, stdout and stderr together). The
process runs in its own session (so a signal to the process group reaches everything it
started) under :mod:`.podinit`, which gives it private mount and UTS namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from finetune_local.mountpoints import MountPoints
from finetune_local.podspec import ConfigMissingError, secret_data

FetchConfig = Callable[[str, str, str], Awaitable["dict[str, Any] | None"]]  # kind, ns, name
# (namespace, claim name) -> the host directory the claim is bound to; None: no such claim.
BindClaim = Callable[[str, str], Awaitable["pathlib.Path | None"]]
_LAUNCHER = pathlib.Path(__file__).with_name("podinit.py")


class IsolationUnavailableError(RuntimeError):
    """Mount/UTS namespaces cannot be created here: pods cannot run faithfully."""


def pod_dir(data_dir: pathlib.Path, pod: Mapping[str, Any]) -> pathlib.Path:
    meta = pod["metadata"]
    folder = f"{meta['name']}-{str(meta['uid'])[:8]}"
    return data_dir / "pods" / str(meta.get("namespace", "default")) / folder


async def materialise_volumes(
    pod: Mapping[str, Any],
    directory: pathlib.Path,
    data_dir: pathlib.Path,
    fetch: FetchConfig,
    bind: BindClaim,
) -> dict[str, tuple[pathlib.Path, bool]]:
    """Volume name -> (host path, read-only by nature)."""
    namespace = pod["metadata"].get("namespace", "default")
    volumes: dict[str, tuple[pathlib.Path, bool]] = {}
    for volume in pod.get("spec", {}).get("volumes") or []:
        name = volume["name"]
        target = directory / "volumes" / name
        if "configMap" in volume or "secret" in volume:
            kind = "configMap" if "configMap" in volume else "secret"
            ref = volume[kind]
            obj = await fetch(kind, namespace, ref.get("name") or ref.get("secretName", ""))
            if obj is None and not ref.get("optional"):
                raise ConfigMissingError(
                    f"{kind} {ref.get('name') or ref.get('secretName')!r} not found"
                )
            data = (
                (secret_data(obj) if kind == "secret" else dict(obj.get("data") or {}))
                if obj
                else {}
            )
            items = ref.get("items") or [{"key": k, "path": k} for k in data]
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            for item in items:
                if item["key"] in data:
                    path = target / item["path"]
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(data[item["key"]])
            volumes[name] = (target, True)
        elif "emptyDir" in volume:
            target.mkdir(parents=True, exist_ok=True)
            volumes[name] = (target, False)
        elif "hostPath" in volume:
            host = pathlib.Path(volume["hostPath"]["path"])
            if volume["hostPath"].get("type", "") in ("", "DirectoryOrCreate"):
                host.mkdir(parents=True, exist_ok=True)
            volumes[name] = (host, False)
        elif "persistentVolumeClaim" in volume:
            claim_name = volume["persistentVolumeClaim"]["claimName"]
            claim = await bind(namespace, claim_name)
            if claim is None:  # as on Kubernetes: the pod waits for the claim to exist
                raise ConfigMissingError(f'persistentvolumeclaim "{claim_name}" not found')
            volumes[name] = (claim, bool(volume["persistentVolumeClaim"].get("readOnly")))
        else:
            raise ConfigMissingError(f"volume {name!r}: unsupported volume type {sorted(volume)}")
    return volumes


def container_mounts(
    container: Mapping[str, Any],
    volumes: Mapping[str, tuple[pathlib.Path, bool]],
    hosts_file: pathlib.Path,
    mountpoints: MountPoints,
) -> list[dict[str, Any]]:
    mounts = [{"source": str(hosts_file), "target": "/etc/hosts", "readOnly": False}]
    for mount in container.get("volumeMounts") or []:
        if mount["name"] not in volumes:
            raise ConfigMissingError(f"volumeMount {mount['name']!r} names no volume of the pod")
        source, read_only = volumes[mount["name"]]
        if mount.get("subPath"):
            source = source / mount["subPath"]
            if not source.exists():
                source.mkdir(parents=True)
        target = pathlib.Path(mount["mountPath"])
        mountpoints.ensure(target, is_file=source.is_file())
        mounts.append(
            {
                "source": str(source),
                "target": str(target),
                "readOnly": read_only or bool(mount.get("readOnly")),
            }
        )
    return mounts


def image_paths(data_dir: pathlib.Path) -> list[str]:
    """What stands for the pod's image on this host: the Python environment, the project's
    packages and the cluster's data dir. A volume must never hide them (see podinit)."""
    paths = {sys.prefix, sys.base_prefix, str(data_dir.resolve())}
    for package in ("finetune_operator", "finetune_trainer"):
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            paths.add(str(pathlib.Path(location).resolve().parent))
    return sorted(paths)


async def spawn(
    spec: dict[str, Any], spec_path: pathlib.Path, env: Mapping[str, str], log_path: pathlib.Path
) -> asyncio.subprocess.Process:
    spec_path.write_text(json.dumps({**spec, "parentPid": os.getpid()}))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-S",
            str(_LAUNCHER),
            str(spec_path),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,  # own process group: signals reach all of it
        )


def signal_group(pid: int, sig: signal.Signals) -> bool:
    try:
        os.killpg(pid, sig)  # pid == pgid: start_new_session made the pod its group leader
        return True
    except ProcessLookupError:
        return False


def _live_processes() -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process."""
    parents = {}
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(proc.name)] = int(fields[1])
    return parents


def pod_processes(pid: int) -> list[int]:
    """The pod's first process and all its live descendants. torchrun starts its workers in
    sessions of their own, so the pod's process group does not hold them; a container runtime
    reaches them through the container's cgroup, this through the process tree."""
    parents = _live_processes()
    found = [pid] if pid in parents else []
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found.extend(frontier)
    return found


async def kill_pod_processes(pid: int, timeout: float, also: Iterable[int] = ()) -> bool:
    """SIGKILL every process of the pod and wait until all have exited, as a runtime stops a
    container (all of its cgroup, not only its first process). `also`: its processes read
    before a SIGTERM (a dead parent's children leave the tree at once)."""
    targets = sorted({*pod_processes(pid), *also})
    signal_group(pid, signal.SIGKILL)
    for target in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        alive = set(_live_processes())
        if not alive.intersection(targets):
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.1)


def exit_code(returncode: int) -> int:
    """As a container runtime reports it: 128 + signal number for a killed process."""
    return 128 - returncode if returncode < 0 else returncode


async def probe_isolation(work: pathlib.Path) -> None:
    """Fail loudly when namespaces cannot be made, instead of running pods half-isolated."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "hostname": "probe",
        "mounts": [],
        "workingDir": str(work),
        "argv": ["true"],
        "probe": True,
    }
    log = work / "isolation-probe.log"
    proc = await spawn(
        spec, work / "isolation-probe.json", {"PATH": os.environ.get("PATH", "")}, log
    )
    if await proc.wait() != 0:
        raise IsolationUnavailableError(
            "the local kubelet needs mount and UTS namespaces (unshare CLONE_NEWNS|CLONE_NEWUTS, "
            f"i.e. root or CAP_SYS_ADMIN) to give each pod its hostname and /etc/hosts: "
            f"{log.read_text().strip()}"
        )
