"""Conditions per the Kubernetes API conventions, the derived phase, and transition events."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from finetune_operator.api.constants import (
    COND_FAILED,
    COND_HANG_DETECTED,
    COND_STRAGGLER_DETECTED,
    COND_SUCCEEDED,
    COND_WORKERS_READY,
    PHASE_FAILED,
    PHASE_PENDING,
    PHASE_RESTARTING,
    PHASE_RUNNING,
    PHASE_SUCCEEDED,
    PHASE_SUSPENDED,
    REASON_ADDED_WHILE_RUNNING,
    REASON_BACKOFF_LIMIT_EXCEEDED,
    REASON_CHANGED_WHILE_RUNNING,
    REASON_INVALID_SPEC,
    REASON_KUEUE_UNREADABLE,
    REASON_NOT_ALLOWED,
    REASON_PLAN_INFEASIBLE,
    REASON_RESTARTING,
    REASON_RUNNING,
    REASON_SUSPENDED,
    REASON_TRAINER_REFUSED,
    REASON_UNSUPPORTED,
)
from finetune_operator.api.status import Condition
from finetune_operator.reconcile.observed import format_time

ConditionStatus = Literal["True", "False", "Unknown"]
EventType = Literal["Normal", "Warning"]

WARNING_REASONS = frozenset(
    {
        REASON_RESTARTING,
        REASON_BACKOFF_LIMIT_EXCEEDED,
        REASON_TRAINER_REFUSED,
        REASON_NOT_ALLOWED,
        REASON_INVALID_SPEC,
        REASON_PLAN_INFEASIBLE,
        REASON_UNSUPPORTED,
        REASON_ADDED_WHILE_RUNNING,
        REASON_CHANGED_WHILE_RUNNING,
        REASON_KUEUE_UNREADABLE,
    }
)


@dataclass(frozen=True)
class EventSpec:
    """A Kubernetes Event to post on the FineTuneJob."""

    type: EventType
    reason: str
    message: str


@dataclass(frozen=True)
class Want:
    """The desired state of one condition; message None keeps the current message."""

    status: ConditionStatus
    reason: str
    message: str | None = None


def find(conditions: Sequence[Condition], ctype: str) -> Condition | None:
    return next((c for c in conditions if c.type == ctype), None)


def is_true(conditions: Sequence[Condition], ctype: str) -> bool:
    cond = find(conditions, ctype)
    return cond is not None and cond.status == "True"


def set_condition(
    conditions: Sequence[Condition],
    ctype: str,
    want: Want,
    now: datetime,
    generation: int | None,
) -> list[Condition]:
    """A copy with `ctype` set; lastTransitionTime moves only when the status changes."""
    old = find(conditions, ctype)
    transition = format_time(now)
    message = want.message
    if old is not None:
        if old.status == want.status:
            transition = old.last_transition_time
        if message is None and old.reason == want.reason:
            message = old.message
    new = Condition(
        type=ctype,
        status=want.status,
        reason=want.reason,
        message=message or "",
        last_transition_time=transition,
        observed_generation=generation,
    )
    if old is None:
        return [*conditions, new]
    return [new if c.type == ctype else c for c in conditions]


def derive_phase(conditions: Sequence[Condition]) -> str:
    """The phase for `kubectl get`: read from the conditions, never the other way round."""
    if is_true(conditions, COND_FAILED):
        return PHASE_FAILED
    if is_true(conditions, COND_SUCCEEDED):
        return PHASE_SUCCEEDED
    succeeded = find(conditions, COND_SUCCEEDED)
    reason = succeeded.reason if succeeded is not None else ""
    return {
        REASON_SUSPENDED: PHASE_SUSPENDED,
        REASON_RESTARTING: PHASE_RESTARTING,
        REASON_RUNNING: PHASE_RUNNING,
    }.get(reason, PHASE_PENDING)


def condition_events(old: Sequence[Condition], new: Sequence[Condition]) -> list[EventSpec]:
    """One Event per condition whose status or reason changed."""
    events: list[EventSpec] = []
    for cond in new:
        if cond.type in (COND_STRAGGLER_DETECTED, COND_HANG_DETECTED):
            continue  # reconcile/health.py posts its own, richer events
        before = find(old, cond.type)
        if before is not None and (before.status, before.reason) == (cond.status, cond.reason):
            continue
        if before is None and cond.type == COND_WORKERS_READY and cond.status != "True":
            continue  # "not ready yet" on the first visit is not news
        bad = cond.reason in WARNING_REASONS or (cond.type == COND_FAILED and cond.status == "True")
        text = f"{cond.type}={cond.status}" + (f": {cond.message}" if cond.message else "")
        events.append(EventSpec("Warning" if bad else "Normal", cond.reason, text))
    return events
