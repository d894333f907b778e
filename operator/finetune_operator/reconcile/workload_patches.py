"""The writes a job controller owes Kueue's Workload (pure, `now` passed in), as its
jobframework reconciler makes them: the quota given back after an eviction once the pods are
gone, PodsReady for waitForPodsReady, Finished, and the resource-in-use finalizer removed (or
added to a Workload written before the operator set it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from finetune_operator.reconcile.admission import (
    ADMITTED,
    EVICTED,
    FINISHED,
    PODS_READY,
    QUOTA_RESERVED,
    condition_true,
    workload_conditions,
)
from finetune_operator.reconcile.observed import format_time
from finetune_operator.resources.workload import RESOURCE_IN_USE

REQUEUED = "Requeued"
# The eviction reasons after which Kueue's job reconciler sets Requeued True when it gives the
# quota back (WorkloadEvictedByPreemption, WorkloadEvictedDueToNodeFailures); any other
# (Deactivated, PodsReadyTimeout, an admission check...) sets it False, for Kueue to decide.
_REQUEUED_AFTER = ("Preempted", "NodeFailures")
# Kueue's reason for a Workload waiting for quota (UnsetQuotaReservationWithCondition's).
REASON_PENDING = "Pending"
MAX_CONDITION_MESSAGE = 32768  # metav1.Condition's limit
# PodsReady's reasons and messages, Kueue's (WorkloadStarted, WorkloadWaitForStart, ...).
STARTED = "Started"
RECOVERED = "Recovered"
WAIT_FOR_START = "WaitForStart"
WAIT_FOR_RECOVERY = "WaitForRecovery"
_READY_MESSAGE = "All pods reached readiness and the workload is running"
_NOT_READY_MESSAGE = "Not all pods are ready or succeeded"
_RECOVERY_MESSAGE = "At least one pod has failed, waiting for recovery"


def _condition(ctype: str, status: str, reason: str, message: str, now: datetime,
               generation: int) -> dict[str, Any]:  # fmt: skip
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message[:MAX_CONDITION_MESSAGE],
        "lastTransitionTime": format_time(now),
        "observedGeneration": generation,
    }


def _with(
    conds: Sequence[Mapping[str, Any]], new: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`conds` with `new` set by type; a condition whose status did not change keeps its
    lastTransitionTime (metav1.SetStatusCondition)."""
    out = [dict(c) for c in conds]
    for cond in new:
        old = next((c for c in out if c.get("type") == cond["type"]), None)
        if old is None:
            out.append(cond)
            continue
        keep = old.get("lastTransitionTime") if old.get("status") == cond["status"] else None
        old.update(cond)
        if keep:
            old["lastTransitionTime"] = keep
    return out


def _guarded(workload: Mapping[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    """The patch, with the resourceVersion read: the conditions list is replaced whole (a
    merge patch), so a Kueue write in between must make it fail (409) and be redone."""
    patch: dict[str, Any] = {"status": status}
    version = (workload.get("metadata") or {}).get("resourceVersion")
    if version:
        patch["metadata"] = {"resourceVersion": version}
    return patch


def release_patch(workload: Mapping[str, Any], message: str, now: datetime) -> dict[str, Any]:
    """The status merge patch that gives an evicted Workload's quota back once its pods are
    gone, as Kueue's UnsetQuotaReservationWithCondition: admission cleared, QuotaReserved
    False (Pending, with the eviction's message), Admitted False, Requeued set. Kueue requeues it.
    A True PodsReady goes False (WaitForStart) with it, as Kueue's job reconciler writes it
    for a Workload no longer admitted: left True, the next admission would count as ready
    before any pod is (waitForPodsReady's blockAdmission would not hold the queue back) and
    its first not-ready pass would read as a recovery (timed by recoveryTimeout, if any,
    instead of the start timeout)."""
    gen = int((workload.get("metadata") or {}).get("generation") or 0)
    conds = (workload.get("status") or {}).get("conditions") or []
    new = [_condition(QUOTA_RESERVED, "False", REASON_PENDING, message, now, gen)]
    # Requeued, as Kueue's job reconciler sets it with the release (SetRequeuedCondition):
    # the eviction's reason and message. Kueue's queueing does not read it to admit (only
    # finished, active and quota do), but its metrics time the wait from it, and its workload
    # controller's requeue bookkeeping (backoff, reactivation) keys on its reason.
    evicted = workload_conditions(workload).get(EVICTED)
    if evicted is not None and evicted.get("status") == "True":
        reason = str(evicted.get("reason") or "Evicted")
        again = "True" if reason in _REQUEUED_AFTER else "False"
        new.append(_condition(REQUEUED, again, reason, str(evicted.get("message", "")), now, gen))
    if condition_true(workload_conditions(workload), ADMITTED):
        new.append(
            _condition(
                ADMITTED, "False", "NoReservation", "The workload has no reservation", now, gen
            )
        )
    if condition_true(workload_conditions(workload), PODS_READY):
        new.append(_pods_ready_condition(False, WAIT_FOR_START, now, gen))
    return _guarded(workload, {"admission": None, "conditions": _with(conds, new)})


def _pods_ready_condition(
    ready: bool, reason: str, now: datetime, generation: int
) -> dict[str, Any]:
    message = {
        STARTED: _READY_MESSAGE,
        RECOVERED: _READY_MESSAGE,
        WAIT_FOR_RECOVERY: _RECOVERY_MESSAGE,
    }
    return _condition(PODS_READY, "True" if ready else "False", reason,
                      message.get(reason, _NOT_READY_MESSAGE), now, generation)  # fmt: skip


def pods_ready_reason(ready: bool, was_ready: bool | None, was_reason: str) -> str:
    """The PodsReady reason Kueue's job reconciler gives (generatePodsReadyCondition): ready
    is Started, or Recovered after a WaitForRecovery; not ready is WaitForRecovery once it
    had been ready (or while it recovers), else WaitForStart."""
    if ready:
        return RECOVERED if was_reason in (WAIT_FOR_RECOVERY, RECOVERED) else STARTED
    if was_ready or (was_ready is False and was_reason == WAIT_FOR_RECOVERY):
        return WAIT_FOR_RECOVERY
    return WAIT_FOR_START


def pods_ready_patch(
    workload: Mapping[str, Any], ready: bool, reason: str, now: datetime
) -> dict[str, Any]:
    """The Workload's PodsReady condition, as Kueue's job integrations keep it: True once the
    admitted number of workers is ready; False while they start (WaitForStart) or after one
    was lost (WaitForRecovery); `reason` from pods_ready_reason. Kueue's waitForPodsReady
    evicts a Workload that stays False past its timeout, and holds the next admissions back
    until it is True."""
    gen = int((workload.get("metadata") or {}).get("generation") or 0)
    conds = (workload.get("status") or {}).get("conditions") or []
    return _guarded(
        workload, {"conditions": _with(conds, [_pods_ready_condition(ready, reason, now, gen)])}
    )


def finish_patch(
    workload: Mapping[str, Any], succeeded: bool, message: str, now: datetime, reason: str = ""
) -> dict[str, Any]:
    """The status merge patch that marks the Workload Finished (reason Succeeded or Failed,
    Kueue's WorkloadFinishedReason*, or `reason`: FailedToStart), which releases its quota."""
    gen = int((workload.get("metadata") or {}).get("generation") or 0)
    conds = (workload.get("status") or {}).get("conditions") or []
    reason = reason or ("Succeeded" if succeeded else "Failed")
    new = [_condition(FINISHED, "True", reason, message or reason, now, gen)]
    return _guarded(workload, {"conditions": _with(conds, new)})


def finalizer_release_patch(workload: Mapping[str, Any]) -> dict[str, Any] | None:
    """The metadata merge patch that removes the resource-in-use finalizer (None when the
    Workload does not carry it), with the resourceVersion read: the list is replaced whole,
    so a finalizer someone added in between must make it fail (409) and be redone."""
    meta = workload.get("metadata") or {}
    finalizers = list(meta.get("finalizers") or [])
    if RESOURCE_IN_USE not in finalizers:
        return None
    patch: dict[str, Any] = {"finalizers": [f for f in finalizers if f != RESOURCE_IN_USE]}
    if meta.get("resourceVersion"):
        patch["resourceVersion"] = meta["resourceVersion"]
    return {"metadata": patch}


def finalizer_adopt_patch(workload: Mapping[str, Any]) -> dict[str, Any] | None:
    """The metadata merge patch that adds the resource-in-use finalizer to a Workload that
    lacks it (None when it has it): one written before the operator created its Workloads
    with it, as Kueue's job reconciler creates its own. Guarded by the resourceVersion read,
    as finalizer_release_patch: another finalizer added in between is not dropped."""
    meta = workload.get("metadata") or {}
    finalizers = list(meta.get("finalizers") or [])
    if RESOURCE_IN_USE in finalizers:
        return None
    patch: dict[str, Any] = {"finalizers": [*finalizers, RESOURCE_IN_USE]}
    if meta.get("resourceVersion"):
        patch["resourceVersion"] = meta["resourceVersion"]
    return {"metadata": patch}
