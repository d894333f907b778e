"""Reading the job's Kueue Workload: queued, admitted (how many nodes, which placement), or
evicted (pure); the writes a job controller owes Kueue are in workload_patches.py.

Kueue's contract with a job controller (its jobframework reconciler does the same for the
Job, JobSet, RayJob... integrations): start the job only while the Workload is Admitted, with
the admitted count and the flavors' node labels and tolerations; when the Workload is Evicted
(or its admission is taken away) stop the pods, and once they are gone clear the quota
reservation (`status.admission` null, QuotaReserved False), which requeues it; when the job
ends set the Workload's Finished condition, which releases its quota for good.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from finetune_operator.resources.workload import (
    POD_SET,
    QUEUE_LABEL,
    RESOURCE_IN_USE,
    Placement,
    PriorityRef,
)

ADMITTED = "Admitted"
QUOTA_RESERVED = "QuotaReserved"
EVICTED = "Evicted"
FINISHED = "Finished"
PODS_READY = "PodsReady"
# Kueue's Finished reason for an admission its job reconciler could not apply to the job
# (a permanent podset.Merge error): never admitted again.
FAILED_TO_START = "FailedToStart"


@dataclass(frozen=True)
class QueueState:
    """What the job's Workload says. `admitted_count` is set only while it is Admitted."""

    queue: str
    exists: bool = False
    admitted_count: int | None = None
    placement: Placement = field(default_factory=Placement)
    quota_reserved: bool = False
    evicted: str | None = None  # "reason: message" of a True Evicted condition
    evicted_message: str = ""  # its message alone
    message: str = ""  # Kueue's own words on why it is not admitted (QuotaReserved/Admitted)
    finished: bool = False
    pods_ready: bool | None = None  # the Workload's PodsReady condition (None: never set)
    pods_ready_reason: str = ""  # and its reason (WaitForRecovery makes the next True Recovered)
    missing_flavors: tuple[str, ...] = ()  # assigned ResourceFlavors the operator could not read
    # Its priority class and value, resolved before the Workload is created; or why not.
    priority: tuple[PriorityRef, int] | None = None
    priority_problem: str = ""
    # A Workload of that name owned by something else (a deleted job of the same name, not yet
    # garbage-collected): never written to, never read as this job's admission.
    foreign: bool = False
    # Its podSets no longer match the job's (the spec was edited after it was written): Kueue
    # would admit quota the pods do not ask for. Rewritten while it holds no quota; with
    # quota reserved, the workers stop and it is deleted and created anew (core.py sets it).
    stale: bool = False
    # Its queueName is not the job's queue-name label any more (the label was changed): moved
    # while it holds no quota, as Kueue's job reconciler does; once admitted it runs on there.
    moved: bool = False
    # Why the Workload could not be read at all (its CRD not served, no permission): not a
    # withdrawn admission. Running workers are kept (new pods wait), as with a flavor that
    # cannot be read; only a Workload known absent gates the job as not admitted.
    unreadable: str = ""
    # The job's queue-name label was removed while this Workload (its own, not Finished) is
    # still there. Kueue's webhook refuses that change on a running job of its own
    # integrations (the label is immutable while unsuspended) and ignores a job without the
    # label; the operator cannot refuse it, so the job leaves Kueue: its workers stop (as on
    # an eviction), the Workload is deleted once they are gone (its quota with it), and the
    # job then runs as one without the label. `queue` is the LocalQueue it leaves.
    left: bool = False
    # Why the admission cannot be applied to the job's pods (a flavor's node label, or an
    # admission check's update, on a key the job's pods set otherwise, or two of them
    # disagreeing): Kueue's podset.Merge refuses it and its job reconciler marks the Workload
    # Finished (FailedToStart), which gives the quota back; so does the operator, and the
    # job fails with this message. Also read back from that Finished condition.
    failed_to_start: str = ""
    # It is being deleted (deletionTimestamp: by a user, by garbage collection, or by the
    # operator replacing it or leaving Kueue): as in Kueue's job reconciler, the workers
    # stop, and the resource-in-use finalizer is removed once they are gone.
    deleting: bool = False
    # The Workload as read, for the status patches below (None: not created yet).
    raw: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def admitted(self) -> bool:
        return self.admitted_count is not None and self.evicted is None

    @property
    def unknown(self) -> bool:
        """Whether the admission cannot be told (the Workload or an assigned flavor cannot
        be read): workers already running keep running, no pod is created."""
        return bool(self.unreadable or self.missing_flavors)

    def describe_hold(self) -> str:
        """What the job's condition says while running workers are kept on an unknown admission."""
        why = self.unreadable or self.describe_wait()
        return (
            f"Kueue admission cannot be read ({why}): running workers kept, no new pod until it can"
        )

    def describe_failed_to_start(self) -> str:
        """The job's Failed message when its admission cannot be applied to its pods."""
        return (
            f"Kueue's admission (LocalQueue {self.queue}) cannot be applied: "
            f"{self.failed_to_start}. No pod started with a contradicting selector (Kueue "
            "refuses it likewise); the Workload is marked Finished (FailedToStart) and its "
            "quota given back. The spec is immutable: delete the job and apply it again with "
            "another spec.resources.nodeSelector (it resumes from its checkpoints), or have "
            "the flavor changed, then delete the Workload to queue the job again"
        )

    def describe_wait(self) -> str:
        """Why the job waits, for its condition: the queue, and Kueue's message."""
        if self.left and self.unreadable:
            return (
                f"the {QUEUE_LABEL} label was removed, but its Workload cannot be read "
                f"({self.unreadable}): no pod started until it can be given back"
            )
        if self.left:
            return (
                f"the {QUEUE_LABEL} label was removed: leaving Kueue's LocalQueue {self.queue}; "
                "workers stopped, then its Workload is deleted (its quota given back) and the "
                "job runs outside Kueue"
            )
        if self.deleting:
            return f"queued in LocalQueue {self.queue}: its Workload is being deleted; workers stopped, a new one is created once it is gone"
        if self.foreign:
            return f"queued in LocalQueue {self.queue}: a Workload of the job's name belongs to another owner; waiting for it to be deleted"
        if self.stale:
            return f"queued in LocalQueue {self.queue}: the job's pods changed since its Workload was written; replacing it (its workers stop first)"
        if self.evicted is not None:
            return f"evicted by Kueue from LocalQueue {self.queue} ({self.evicted}); workers stopped, waiting to be admitted again"
        if self.unreadable:
            return f"queued in LocalQueue {self.queue}: {self.unreadable}"
        if not self.exists and self.priority_problem:
            return f"queued in LocalQueue {self.queue}: {self.priority_problem}; its Workload is created once it can be read"
        if not self.exists:
            return f"queued in LocalQueue {self.queue}: creating its Workload"
        if self.missing_flavors:
            names = ", ".join(self.missing_flavors)
            return f"admitted by LocalQueue {self.queue}, but ResourceFlavor {names} cannot be read; waiting"
        why = self.message or "waiting for Kueue to reserve quota"
        return f"queued in LocalQueue {self.queue}: {why}"


def workload_conditions(workload: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    conds = (workload.get("status") or {}).get("conditions") or []
    return {c.get("type", ""): c for c in conds if isinstance(c, Mapping)}


def condition_true(conds: Mapping[str, Mapping[str, Any]], ctype: str) -> bool:
    return conds.get(ctype, {}).get("status") == "True"


def _our_assignment(workload: Mapping[str, Any]) -> Mapping[str, Any] | None:
    admission = (workload.get("status") or {}).get("admission") or {}
    for a in admission.get("podSetAssignments") or []:
        if isinstance(a, Mapping) and a.get("name") == POD_SET:
            return a
    return None


def _pod_set_count(workload: Mapping[str, Any]) -> int:
    for ps in (workload.get("spec") or {}).get("podSets") or []:
        if ps.get("name") == POD_SET:
            return int(ps.get("count", 1))
    return 0


def _merge(
    into: dict[str, str],
    origins: dict[tuple[str, str], str],
    what: str,
    added: Mapping[str, str],
    origin: str,
) -> str:
    """Add `added` to `into` (keys it lacks), or say which key two sources set differently:
    Kueue's PodSetInfo.Merge refuses an admission check's update that contradicts the
    flavors' (or an earlier check's) as a permanent error."""
    for key, value in sorted(added.items()):
        if key in into and into[key] != value:
            first = origins.get((what, key), "")
            return f"{origin} sets {what} {key}={value}, but {first} set {key}={into[key]}"
        if key not in into:
            into[key], origins[(what, key)] = value, origin
    return ""


def _placement(
    workload: Mapping[str, Any],
    assignment: Mapping[str, Any],
    flavors: Mapping[str, Mapping[str, Any]],
) -> tuple[Placement, tuple[str, ...], str]:
    """The admission's placement, the flavors that could not be read, and why it cannot be
    applied at all (two of its sources disagree on a key; "" when they do not)."""
    selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    missing: list[str] = []
    origins: dict[tuple[str, str], str] = {}
    for name in sorted(set((assignment.get("flavors") or {}).values())):
        flavor = flavors.get(name)
        if flavor is None:
            missing.append(name)
            continue
        fspec = flavor.get("spec") or {}
        # Between flavors the first one's label is kept (Kueue's MergeKeepFirst), no error.
        _merge(
            selector,
            origins,
            "nodeSelector",
            fspec.get("nodeLabels") or {},
            f"ResourceFlavor {name}",
        )
        tolerations.extend(t for t in fspec.get("tolerations") or [] if t not in tolerations)
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    conflict = ""
    # Admission checks (a ProvisioningRequest, say) may add to the pods as well.
    for check in (workload.get("status") or {}).get("admissionChecks") or []:
        origin = f"admission check {check.get('name', '')}"
        for update in check.get("podSetUpdates") or []:
            if update.get("name") != POD_SET:
                continue
            conflict = conflict or (
                _merge(labels, origins, "labels", update.get("labels") or {}, origin)
                or _merge(
                    annotations, origins, "annotations", update.get("annotations") or {}, origin
                )
                or _merge(
                    selector, origins, "nodeSelector", update.get("nodeSelector") or {}, origin
                )
            )
            tolerations.extend(t for t in update.get("tolerations") or [] if t not in tolerations)
    placement = Placement(selector, tuple(tolerations), labels, annotations, origins)
    return placement, tuple(missing), conflict


def flavors_assigned(workload: Mapping[str, Any] | None) -> list[str]:
    """The ResourceFlavors the Workload's admission names (for the caller to read)."""
    assignment = _our_assignment(workload or {})
    return sorted(set((assignment or {}).get("flavors", {}).values())) if assignment else []


def read_queue_state(
    queue: str,
    workload: Mapping[str, Any] | None,
    flavors: Mapping[str, Mapping[str, Any]],
    *,
    priority: tuple[PriorityRef, int] | None = None,
    priority_problem: str = "",
    owner_uid: str | None = None,
    unreadable: str = "",
    left: bool = False,
) -> QueueState:
    """The job's standing in Kueue from its Workload (None: not created yet) and the
    ResourceFlavor objects its admission names (by name). `priority` (or why it could not
    be read) matters only while the Workload is still to be created. `owner_uid`: the job's;
    a Workload not owned by it is not its own. `unreadable`: why the Workload could not be
    read (then `workload` is None, and nothing is known of its admission). `left`: the job's
    queue-name label is gone (`queue`: the LocalQueue the Workload names); see QueueState."""
    if unreadable:
        return QueueState(queue, unreadable=unreadable)
    if workload is None:
        return QueueState(queue, priority=priority, priority_problem=priority_problem)
    owners = {o.get("uid") for o in (workload.get("metadata") or {}).get("ownerReferences") or []}
    if owner_uid is not None and owner_uid not in owners:
        return QueueState(queue, exists=True, foreign=True)
    conds = workload_conditions(workload)
    reserved = condition_true(conds, QUOTA_RESERVED)
    finished = condition_true(conds, FINISHED)
    evicted, evicted_message = None, ""
    if condition_true(conds, EVICTED):
        ev = conds[EVICTED]
        evicted_message = str(ev.get("message", ""))
        evicted = f"{ev.get('reason', '')}: {evicted_message}".strip(": ")
    pods_ready = conds[PODS_READY].get("status") == "True" if PODS_READY in conds else None
    pods_ready_reason = str(conds.get(PODS_READY, {}).get("reason", ""))
    # Kueue's reason for waiting: the QuotaReserved condition's message ("couldn't assign
    # flavors to pod set workers: insufficient quota..."), or, once quota is reserved, the
    # Admitted one's (admission checks still pending).
    why = conds.get(ADMITTED if reserved else QUOTA_RESERVED, {}).get("message", "")
    moved = (workload.get("spec") or {}).get("queueName") != queue
    failed = conds.get(FINISHED, {}) if finished else {}
    failed_to_start = (
        str(failed.get("message") or FAILED_TO_START)
        if failed.get("reason") == FAILED_TO_START
        else ""
    )
    state = QueueState(queue, True, None, Placement(), reserved, evicted, evicted_message, why,
                       finished, pods_ready, pods_ready_reason, moved=moved,
                       failed_to_start=failed_to_start, raw=workload)  # fmt: skip
    if (workload.get("metadata") or {}).get("deletionTimestamp"):
        state = replace(state, deleting=True)
    if left:
        return replace(state, left=True, moved=False)
    assignment = _our_assignment(workload)
    if not (condition_true(conds, ADMITTED) and assignment is not None) or evicted is not None:
        return state
    count = assignment.get("count")
    count = int(count) if count is not None else _pod_set_count(workload)
    placement, missing, conflict = _placement(workload, assignment, flavors)
    if missing:
        return replace(state, missing_flavors=missing)
    return replace(state, admitted_count=count, placement=placement, failed_to_start=conflict)


def read_left_queue_state(
    workload: Mapping[str, Any] | None, owner_uid: str, *, unreadable: str = ""
) -> QueueState | None:
    """A job without the queue-name label whose own Workload is still there (the label was
    removed): the state that makes it leave Kueue (QueueState.left). None otherwise: no
    Workload, another owner's, or a Finished one (its quota released) without the
    resource-in-use finalizer left to remove. `unreadable`: why it could not be read; it may
    still hold quota, so it is not forgotten (status.workload kept) and nothing is decided
    blind: running workers kept, no pod added, nothing deleted, until it can be read."""
    if unreadable:
        return QueueState("", unreadable=unreadable, left=True)
    if workload is None:
        return None
    meta = workload.get("metadata") or {}
    owners = {o.get("uid") for o in meta.get("ownerReferences") or []}
    done = condition_true(workload_conditions(workload), FINISHED)
    if owner_uid not in owners or (done and RESOURCE_IN_USE not in (meta.get("finalizers") or [])):
        return None
    queue = str((workload.get("spec") or {}).get("queueName") or "")
    return read_queue_state(queue, workload, {}, owner_uid=owner_uid, left=True)


# What a podSet's quota and flavor choice depend on; the rest of its template may be
# defaulted or rewritten by the API server or Kueue's webhook, and must not read as a change.
_POD_SHAPE = ("nodeSelector", "tolerations", "priorityClassName", "runtimeClassName", "overhead")


def _pod_set_shape(workload: Mapping[str, Any]) -> dict[str, Any] | None:
    pod_set = next(
        (
            ps
            for ps in (workload.get("spec") or {}).get("podSets") or []
            if ps.get("name") == POD_SET
        ),
        None,
    )
    if pod_set is None:
        return None
    spec = (pod_set.get("template") or {}).get("spec") or {}
    containers = {
        kind: {c.get("name"): c.get("resources") or {} for c in spec.get(kind) or []}
        for kind in ("containers", "initContainers")
    }
    return {"count": pod_set.get("count", 1), "minCount": pod_set.get("minCount"),
            **containers, **{k: spec.get(k) or None for k in _POD_SHAPE}}  # fmt: skip


def pod_sets_differ(existing: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether the Workload Kueue holds asks for other pods than the one the job now wants
    (count, minCount, each container's resources, what picks the flavor): Kueue's own job
    reconciler then rewrites it, or stops the job and replaces it (equivalentToWorkload)."""
    held, asked = _pod_set_shape(existing), _pod_set_shape(wanted)
    if held is not None and asked is not None and held["minCount"] is None:
        # Kueue's webhook drops minCount where its PartialAdmission gate is off: not a change.
        asked["minCount"] = None
    return held != asked
