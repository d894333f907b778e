"""What the reconcile functions see of a pod: a small frozen view built from the pod dict."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from finetune_operator.api.constants import (
    LABEL_JOB,
    LABEL_ROLE,
    LABEL_WORKER_INDEX,
    ROLE_RENDEZVOUS,
    ROLE_WORKER,
)
from finetune_operator.reconcile.crash import REASON_OOM_KILLED, crash_cause
from finetune_operator.reconcile.unschedulable import explain_unschedulable, worker_requests

PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"


@dataclass(frozen=True)
class PodView:
    name: str
    uid: str
    job: str
    role: str
    index: int | None = None
    phase: str = PENDING
    ready: bool = False
    node: str | None = None
    ip: str | None = None
    terminating: bool = False
    exit_code: int | None = None
    finished_at: datetime | None = None
    reason: str | None = None
    termination_message: str | None = None  # what the container left in its termination log
    disruption: str | None = (
        None  # DisruptionTarget condition reason, or an eviction's status.reason
    )
    created_at: datetime | None = None  # metadata.creationTimestamp
    # Why the pod cannot start, as the scheduler ("Unschedulable: 0/4 nodes are available: ...")
    # or the kubelet says ("CreateContainerConfigError: secret \"s3\" not found"); None while
    # it is merely being scheduled or created.
    blocked: str | None = None
    memory_limit: str | None = None  # the container's resources.limits.memory, for OOMKilled
    # A terminating pod's deletionTimestamp (the delete's time plus its grace period: when a
    # live kubelet will have stopped it) and deletionGracePeriodSeconds (nodeloss.py).
    deletion_deadline: datetime | None = None
    deletion_grace: int | None = None

    @property
    def is_worker(self) -> bool:
        return self.role == ROLE_WORKER and self.index is not None

    @property
    def is_rendezvous(self) -> bool:
        return self.role == ROLE_RENDEZVOUS

    @property
    def active(self) -> bool:
        """Still holds (or will hold) a node and may still make progress."""
        return not self.terminating and self.phase in (PENDING, RUNNING)

    def describe_failure(self) -> str:
        """ "pod w-1 failed on node n (exit code 1, Error): rank 3: ValueError: ... (x.py:9)":
        the root cause when the trainer's report, its log's tail or the kubelet gives one."""
        detail = f"exit code {self.exit_code}" if self.exit_code is not None else "no exit code"
        if self.reason and self.reason != REASON_OOM_KILLED:  # the cause says it, with the limit
            detail += f", {self.reason}"
        where = f" on node {self.node}" if self.node else ""
        cause = crash_cause(
            self.termination_message, self.reason, self.memory_limit, self.exit_code
        )
        return f"pod {self.name} failed{where} ({detail})" + (f": {cause}" if cause else "")


def format_time(when: datetime) -> str:
    """RFC 3339 in UTC with a Z, as the API server writes times."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _int(text: Any, default: int | None) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return default


def _terminated(status: Mapping[str, Any]) -> Mapping[str, Any]:
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return dict(term)
    return {}


# Pod status reasons Kubernetes sets when a pod was stopped from outside, not by its own fault
# (kubelet eviction, node shutdown, scheduler preemption).
DISRUPTION_REASONS = frozenset(
    {"Evicted", "Shutdown", "NodeShutdown", "Terminated", "Preempting", "NodeLost"}
)


# Waiting reasons of a container on its normal way to running: not worth reporting.
STARTING_REASONS = frozenset({"ContainerCreating", "PodInitializing"})


def _memory_limit(spec: Mapping[str, Any]) -> str | None:
    for container in spec.get("containers") or []:
        memory = ((container.get("resources") or {}).get("limits") or {}).get("memory")
        if memory:
            return str(memory)
    return None


# Up to 3 blocked pods are named in a condition message, which must stay under 1 KiB.
MAX_BLOCKED_CHARS = 300


def _clip(text: str) -> str:
    return text if len(text) <= MAX_BLOCKED_CHARS else text[: MAX_BLOCKED_CHARS - 3] + "..."


def _blocked(status: Mapping[str, Any], worker_spec: Mapping[str, Any] | None) -> str | None:
    for c in status.get("conditions") or []:
        # The scheduler found no node (no free GPUs, taints, affinity, a gang that does not
        # fit whole): the commonest reason a job waits, in the scheduler's own words; for a
        # worker short of a resource, first which request and which spec field set it.
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            reason, message = c.get("reason") or "Unschedulable", c.get("message")
            hint = None
            if message and worker_spec is not None:
                hint = explain_unschedulable(str(message), worker_requests(worker_spec))
            if hint:
                message = f"{hint}; scheduler: {message}"
            return _clip(f"{reason}: {message}" if message else str(reason))
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason and reason not in STARTING_REASONS:
            message = waiting.get("message")
            return _clip(f"{reason}: {message}" if message else str(reason))
    return None


def _disruption(status: Mapping[str, Any]) -> str | None:
    for c in status.get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            return str(c.get("reason") or "DisruptionTarget")
    reason = status.get("reason")
    return str(reason) if reason in DISRUPTION_REASONS else None


def observe_pod(pod: Mapping[str, Any]) -> PodView:
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    labels = meta.get("labels") or {}
    term = _terminated(status)
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return PodView(
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        job=str(labels.get(LABEL_JOB, "")),
        role=str(labels.get(LABEL_ROLE, "")),
        index=_int(labels.get(LABEL_WORKER_INDEX), None),
        phase=str(status.get("phase") or PENDING),
        ready=ready,
        node=spec.get("nodeName"),
        ip=status.get("podIP"),
        terminating=meta.get("deletionTimestamp") is not None,
        exit_code=_int(term.get("exitCode"), None),
        finished_at=parse_time(term.get("finishedAt")),
        reason=term.get("reason") or status.get("reason"),
        termination_message=term.get("message") or None,
        disruption=_disruption(status),
        created_at=parse_time(meta.get("creationTimestamp")),
        blocked=_blocked(status, spec if labels.get(LABEL_ROLE) == ROLE_WORKER else None),
        memory_limit=_memory_limit(spec),
        deletion_deadline=parse_time(meta.get("deletionTimestamp")),
        deletion_grace=_int(meta.get("deletionGracePeriodSeconds"), None),
    )


def mark_terminating(pods: Iterable[PodView], deleted_uids: Iterable[str]) -> list[PodView]:
    """Pods we already deleted but whose deletion the watch has not shown yet."""
    gone = set(deleted_uids)
    return [dataclasses.replace(p, terminating=True) if p.uid in gone else p for p in pods]
