"""emptyDir volumes as a kubelet keeps them: a directory of the pod that survives its
container's restarts and is deleted with the pod, and a `sizeLimit` enforced by evicting the
pod (the eviction manager's local-storage check: phase Failed, reason Evicted, its message),
rather than by the filesystem refusing writes."""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from finetune_local.resourcefit import parse_quantity

EVICTED = "Evicted"
# The kubelet's eviction manager checks every housekeeping period (10 s by default).
CHECK_INTERVAL_SECONDS = 2.0
# Evicting for local storage gives the containers 1 s (immediateEvictionGracePeriodSeconds).
EVICTION_GRACE_SECONDS = 1.0


@dataclass(frozen=True)
class SizeLimit:
    volume: str
    path: pathlib.Path
    limit_bytes: int
    limit_text: str


def volumes_dir(pod_directory: pathlib.Path) -> pathlib.Path:
    return pod_directory / "volumes"


def size_limits(pod: Mapping[str, Any], pod_directory: pathlib.Path) -> list[SizeLimit]:
    """The pod's disk-backed emptyDirs that declare a sizeLimit (a Memory one is a tmpfs the
    memory limit covers)."""
    out = []
    for volume in pod.get("spec", {}).get("volumes") or []:
        empty = volume.get("emptyDir")
        if empty is None or empty.get("medium") == "Memory" or not empty.get("sizeLimit"):
            continue
        text = str(empty["sizeLimit"])
        path = volumes_dir(pod_directory) / volume["name"]
        out.append(SizeLimit(volume["name"], path, int(parse_quantity(text)), text))
    return out


def disk_usage(path: pathlib.Path) -> int:
    """Bytes allocated under `path`, as `du` counts them (what the kubelet measures)."""
    total = 0
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:  # removed while walking
                continue
    return total


def over_limit(limits: list[SizeLimit], usage: Mapping[str, int]) -> str | None:
    """Pure: the eviction message for the first volume above its limit, else None."""
    for limit in limits:
        if usage.get(limit.volume, 0) > limit.limit_bytes:
            return f'Usage of EmptyDir volume "{limit.volume}" exceeds the limit "{limit.limit_text}". '
    return None


def remove_pod_volumes(pod_directory: pathlib.Path) -> None:
    """Deletes the pod's emptyDirs (and its copies of configMaps and secrets): gone with the
    pod, as on a node."""
    shutil.rmtree(volumes_dir(pod_directory), ignore_errors=True)
