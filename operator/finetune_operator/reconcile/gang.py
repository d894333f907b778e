"""What the job's PodGroup status says about its gang (pure), and the status it gives the job.

The gang scheduler, not the operator, knows why a group waits: the worker pods only say they
are Unschedulable, one by one. Both schedulers write their verdict in the PodGroup's status,
which the operator reads with one GET per pass (no watch: its CRD may not exist):

- Volcano (`scheduling.volcano.sh/v1beta1`): `phase` Pending, Inqueue (admitted by its queue,
  not yet placed), Unknown (some of `minMember` placed, the others cannot be), Running,
  Completed; `conditions` of type Unschedulable (reason NotEnoughResources, ..., and a
  message such as "3/4 tasks in gang unschedulable: ...") or Scheduled; counts `running`,
  `succeeded`, `failed`.
- scheduler-plugins' Coscheduling (`scheduling.x-k8s.io/v1alpha1`): `phase` Pending,
  Scheduling (minMember bound, not yet running), Running, Unknown, Finished, Failed (older
  releases also PreScheduling, Scheduled, ScheduleTimeout and a `scheduled` count); the same
  counts; no conditions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

from finetune_operator.api.constants import (
    COND_GANG_SCHEDULED,
    COND_SUCCEEDED,
    COND_WORKERS_READY,
    REASON_EVICTED,
    REASON_GANG_SCHEDULED,
    REASON_GANG_STATUS_UNKNOWN,
    REASON_GANG_TIMED_OUT,
    REASON_PENDING,
    REASON_QUEUED,
    REASON_RESTARTING,
    REASON_RUNNING,
    REASON_SUSPENDED,
    REASON_WAITING_FOR_GANG,
)
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile.conditions import (
    ConditionStatus,
    EventSpec,
    Want,
    find,
    set_condition,
)
from finetune_operator.reconcile.core import Outcome
from finetune_operator.reconcile.crash import shorten
from finetune_operator.reconcile.observed import parse_time
from finetune_operator.resources.podgroup import gang_of, pod_group_name

MAX_MESSAGE_CHARS = 1000
# A running job's gang is read until seen placed, but no longer than this after its workers
# became ready: a scheduler that writes no status (or a PodGroup the operator may not read)
# would otherwise cost a GET every pass for the whole run, to say what the running workers
# already show.
READ_WHILE_RUNNING = timedelta(minutes=5)


class GangVerdict(Enum):
    SCHEDULED = "scheduled"  # minMember placed together (running, finished or failed since)
    WAITING = "waiting"  # the scheduler cannot place minMember at once yet
    TIMED_OUT = "timed-out"  # Coscheduling gave up for scheduleTimeoutSeconds; it retries
    NOT_REPORTED = "not-reported"  # no PodGroup yet, or no status from its scheduler yet
    UNKNOWN = "unknown"  # a phase this operator does not know, or a GET that failed


# Phases by verdict, both schedulers together: their names do not contradict each other.
# "Unknown" is waiting in both: part of minMember placed and the rest cannot be.
_SCHEDULED = frozenset({"Running", "Scheduling", "Scheduled", "Completed", "Finished", "Failed"})
_WAITING = frozenset({"Pending", "Inqueue", "PreScheduling", "Unknown"})
_TIMED_OUT = frozenset({"ScheduleTimeout"})


@dataclass(frozen=True)
class GangReading:
    """The job's PodGroup status as read: the verdict and what to tell the user."""

    verdict: GangVerdict
    name: str
    phase: str = ""
    min_member: int = 0
    placed: int = 0  # pods bound (`scheduled` where reported) or running/finished
    reason: str = ""  # the scheduler's own reason (Volcano's Unschedulable condition)
    message: str = ""  # the scheduler's message, or why the status could not be read
    failed_read: bool = False  # the GET failed (`message` says why)

    def describe(self) -> str:
        """The sentence `kubectl describe ftj` shows for this gang."""
        why = ": ".join(x for x in (self.reason, self.message) if x)
        tail = f": {why}" if why else ""
        where = f"PodGroup {self.name}"
        if self.verdict is GangVerdict.NOT_REPORTED:
            return f"{where}: {self.message or 'the gang scheduler has not reported on it yet'}"
        if self.verdict is GangVerdict.UNKNOWN:
            what = f"phase {self.phase!r} is not one this operator knows" if self.phase else ""
            return f"{where}: {what or self.message}"
        counts = f"{self.placed}/{self.min_member} pods placed"
        if self.verdict is GangVerdict.SCHEDULED:
            return f"gang placed: {where} is {self.phase}, {counts}"
        if self.verdict is GangVerdict.TIMED_OUT:
            return f"gang timed out waiting to be placed and is retried: {where}, {counts}{tail}"
        return f"waiting for gang: {counts} ({where} {self.phase}){tail}"


def _count(status: Mapping[str, Any], key: str) -> int:
    value = status.get(key)
    return value if isinstance(value, int) and value >= 0 else 0


def _unschedulable(status: Mapping[str, Any]) -> tuple[str, str]:
    """Volcano's latest Unschedulable condition (reason, message); Coscheduling has none."""
    conds = status.get("conditions")
    for cond in reversed(conds if isinstance(conds, list) else []):
        # Volcano keeps the last Unschedulable condition even once placed; it is current
        # only while its status is True.
        if (
            isinstance(cond, dict)
            and cond.get("type") == "Unschedulable"
            and cond.get("status", "True") == "True"
        ):
            return str(cond.get("reason") or ""), str(cond.get("message") or "")
    return "", ""


def read_gang(group: Mapping[str, Any] | None, name: str, unreadable: str = "") -> GangReading:
    """What the PodGroup `group` (None: it does not exist) says of the gang; `unreadable`:
    why the GET failed (its CRD not served, no permission)."""
    if unreadable:
        return GangReading(GangVerdict.UNKNOWN, name, message=unreadable, failed_read=True)
    if group is None:
        return GangReading(GangVerdict.NOT_REPORTED, name, message="not created yet")
    spec, status = group.get("spec") or {}, group.get("status") or {}
    min_member = spec.get("minMember")
    min_member = min_member if isinstance(min_member, int) else 0
    phase = str(status.get("phase") or "")
    if "scheduled" in status:
        placed = _count(status, "scheduled")
    else:
        placed = sum(_count(status, k) for k in ("running", "succeeded", "failed"))
    reading = GangReading(GangVerdict.UNKNOWN, name, phase, min_member, placed)
    if not phase:
        return dataclasses.replace(reading, verdict=GangVerdict.NOT_REPORTED)
    if phase in _SCHEDULED:
        return dataclasses.replace(reading, verdict=GangVerdict.SCHEDULED)
    reason, message = _unschedulable(status)
    if phase in _WAITING:
        verdict = GangVerdict.WAITING
    elif phase in _TIMED_OUT:
        verdict = GangVerdict.TIMED_OUT
    else:
        return reading
    return dataclasses.replace(reading, verdict=verdict, reason=reason, message=message)


_CONDITION: dict[GangVerdict, tuple[ConditionStatus, str]] = {
    GangVerdict.SCHEDULED: ("True", REASON_GANG_SCHEDULED),
    GangVerdict.WAITING: ("False", REASON_WAITING_FOR_GANG),
    GangVerdict.TIMED_OUT: ("False", REASON_GANG_TIMED_OUT),
    GangVerdict.NOT_REPORTED: ("Unknown", REASON_WAITING_FOR_GANG),
    GangVerdict.UNKNOWN: ("Unknown", REASON_GANG_STATUS_UNKNOWN),
}


def gang_want(reading: GangReading) -> Want:
    """The GangScheduled condition for `reading`."""
    text = shorten(reading.describe(), MAX_MESSAGE_CHARS)
    return Want(*_CONDITION[reading.verdict], text)


def note_gang(
    status: FineTuneJobStatus, reading: GangReading, now: datetime, generation: int
) -> FineTuneJobStatus:
    """`status` with GangScheduled set from `reading`; while the gang waits and the job has no
    ready workers to speak of (Succeeded's reason Pending or Restarting), Succeeded's message
    also says so: the scheduler's reason is what a user needs there."""
    conds = set_condition(
        status.conditions, COND_GANG_SCHEDULED, gang_want(reading), now, generation
    )
    progress = find(conds, COND_SUCCEEDED)
    if (
        reading.verdict in (GangVerdict.WAITING, GangVerdict.TIMED_OUT)
        and progress is not None
        and progress.status == "Unknown"
        and progress.reason in (REASON_PENDING, REASON_RESTARTING)
        and "; waiting for gang" not in progress.message
        and "; gang timed out" not in progress.message
    ):
        text = shorten(f"{progress.message}; {reading.describe()}", MAX_MESSAGE_CHARS)
        want = Want("Unknown", progress.reason, text)
        conds = set_condition(conds, COND_SUCCEEDED, want, now, progress.observed_generation)
    return status.model_copy(update={"conditions": conds})


def gang_events(old: FineTuneJobStatus, new: FineTuneJobStatus) -> list[EventSpec]:
    """An Event when GangScheduled changes status or reason (not on each new message, nor
    for "not reported yet", which every new group goes through)."""
    before, after = (
        find(old.conditions, COND_GANG_SCHEDULED),
        find(new.conditions, COND_GANG_SCHEDULED),
    )
    if after is None or (
        before is not None and (before.status, before.reason) == (after.status, after.reason)
    ):
        return []
    if after.status == "Unknown" and after.reason == REASON_WAITING_FOR_GANG:
        return []
    bad = after.reason in (REASON_GANG_TIMED_OUT, REASON_GANG_STATUS_UNKNOWN)
    text = f"{COND_GANG_SCHEDULED}={after.status}: {after.message}"
    return [EventSpec("Warning" if bad else "Normal", after.reason, text)]


def pod_group_to_read(out: Outcome, now: datetime) -> tuple[str, str] | None:
    """(apiVersion, name) of the PodGroup whose status this pass reads, or None: only for a
    gang-scheduled job whose workers are being placed (or re-placed); a running job's gang,
    once seen placed or READ_WHILE_RUNNING after its workers became ready, is not read again
    until it restarts."""
    ev = out.evaluation
    found = gang_of(ev.spec) if ev.ok and ev.spec is not None else None
    progress = find(out.status.conditions, COND_SUCCEEDED)
    if found is None or progress is None or progress.status != "Unknown":
        return None
    if progress.reason not in (REASON_PENDING, REASON_RESTARTING, REASON_RUNNING):
        return None  # queued by Kueue, suspended, finished: no group to place
    gang = find(out.status.conditions, COND_GANG_SCHEDULED)
    if progress.reason == REASON_RUNNING:
        if gang is not None and gang.status == "True":
            return None
        ready = find(out.status.conditions, COND_WORKERS_READY)
        since = parse_time(ready.last_transition_time) if ready is not None else None
        if (
            ready is not None
            and ready.status == "True"
            and since is not None
            and (now - since > READ_WHILE_RUNNING)
        ):
            return None
    return found[1].api_version, pod_group_name(ev.job.owner)


def released_gang(out: Outcome) -> GangReading | None:
    """What to say of the gang, without reading it, while the job holds no PodGroup
    (suspended, or queued or evicted by Kueue): a GangScheduled=True left from before would
    claim a placement the job gave back; or once the job finished while its gang waited.
    None when there is nothing to change."""
    ev = out.evaluation
    found = gang_of(ev.spec) if ev.ok and ev.spec is not None else None
    progress = find(out.status.conditions, COND_SUCCEEDED)
    gang = find(out.status.conditions, COND_GANG_SCHEDULED)
    if found is None or progress is None or gang is None or gang.status == "Unknown":
        return None
    name = pod_group_name(ev.job.owner)
    if progress.status != "Unknown":
        # Finished while its gang waited: a "waiting for gang" left on a finished job reads
        # as if it still waited. A gang seen placed stays so: that is its history.
        if gang.status != "False":
            return None
        return GangReading(GangVerdict.NOT_REPORTED, name, message="none: the job has finished")
    if progress.reason not in (REASON_SUSPENDED, REASON_QUEUED, REASON_EVICTED):
        return None
    why = f"none while the job is {progress.reason.lower()}"
    return GangReading(GangVerdict.NOT_REPORTED, name, message=why)


def with_gang(out: Outcome, old: FineTuneJobStatus, reading: GangReading, now: datetime) -> Outcome:
    """`out` with the gang's reading in its status, and an Event if GangScheduled moved. A
    GET that failed (`unreadable`: an API server hiccup, mostly) does not replace a verdict
    the scheduler gave before: the condition would flap to Unknown and back, with a Warning
    and an Event for each flip; the verdict read last is still the best known."""
    gang = find(out.status.conditions, COND_GANG_SCHEDULED)
    if reading.failed_read and gang is not None and gang.status in ("True", "False"):
        return out
    status = note_gang(out.status, reading, now, out.evaluation.job.generation)
    return dataclasses.replace(out, status=status, events=(*out.events, *gang_events(old, status)))
