"""Pod status documents as the local kubelet reports them (phase, conditions, container states)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from finetune_local.emptydir import EVICTED


def timestamp(moment: datetime.datetime) -> str:
    """An API timestamp (RFC 3339, seconds, UTC)."""
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now() -> str:
    return timestamp(datetime.datetime.now(datetime.UTC))


def ready_status(obj: Mapping[str, Any]) -> str:
    """The Ready condition's status of a pod or a node ("True", "False", "Unknown"; "" without
    one)."""
    for cond in obj.get("status", {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return str(cond.get("status") or "")
    return ""


def conditions(ready: bool, reason: str = "") -> list[dict[str, Any]]:
    stamp = now()
    value = "True" if ready else "False"
    result = [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
        {"type": "Initialized", "status": "True", "lastTransitionTime": stamp},
    ]
    for kind in ("ContainersReady", "Ready"):
        condition = {"type": kind, "status": value, "lastTransitionTime": stamp}
        if reason:
            condition["reason"] = reason
        result.append(condition)
    return result


def container_base(container: Mapping[str, Any], pid: int, restart_count: int) -> dict[str, Any]:
    return {
        "name": container.get("name", "main"),
        "image": container.get("image", ""),
        "imageID": "",
        "restartCount": restart_count,
        "containerID": f"local://{pid}",
    }


def waiting(container: Mapping[str, Any], reason: str, message: str) -> dict[str, Any]:
    return {
        "name": container.get("name", "main"),
        "image": container.get("image", ""),
        "imageID": "",
        "ready": False,
        "started": False,
        "restartCount": 0,
        "state": {"waiting": {"reason": reason, "message": message}},
    }


def running_status(
    pod: Mapping[str, Any],
    ip: str,
    started_at: str,
    pid: int,
    restart_count: int,
    container: Mapping[str, Any],
) -> dict[str, Any]:
    return {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "hostIP": "127.0.0.1",
        "startTime": pod.get("status", {}).get("startTime") or started_at,
        "conditions": conditions(True),
        "containerStatuses": [
            {
                **container_base(container, pid, restart_count),
                "ready": True,
                "started": True,
                "state": {"running": {"startedAt": started_at}},
            }
        ],
    }


def terminated_status(
    container: Mapping[str, Any],
    *,
    ip: str,
    pid: int,
    restart_count: int,
    started_at: str,
    code: int,
    message: str,
    evicted: str,
) -> dict[str, Any]:
    """A pod whose container exited with `code` for good: Succeeded on 0, else Failed; an
    evicted pod (`evicted`, the eviction message) is Failed whatever its code."""
    terminated = {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "startedAt": started_at or now(),
        "finishedAt": now(),
        "containerID": f"local://{pid}",
    }
    if message:
        terminated["message"] = message
    phase = "Succeeded" if code == 0 and not evicted else "Failed"
    status = {
        "phase": phase,
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "hostIP": "127.0.0.1",
        "conditions": conditions(False, "PodCompleted" if code == 0 else "PodFailed"),
        "containerStatuses": [
            {
                **container_base(container, pid, restart_count),
                "ready": False,
                "started": False,
                "state": {"terminated": terminated},
            }
        ],
    }
    if evicted:
        status.update(reason=EVICTED, message=evicted)
    return status
