"""What one reconcile pass asks the apply layer to do (`Actions`), and its parts: the pods to
delete (`PodDeletion`) and the custom objects to delete (`ObjectRef`). Built by actions.py,
applied by apply.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune_operator.reconcile.conditions import EventSpec


@dataclass(frozen=True)
class PodDeletion:
    name: str
    uid: str  # a precondition: never delete a replacement that reused the name
    reason: str
    grace_seconds: int | None = None  # None: the pod's own terminationGracePeriodSeconds


@dataclass(frozen=True)
class ObjectRef:
    """A custom object to delete (the PodGroup of a suspended or finished job)."""

    api_version: str
    kind: str
    plural: str
    name: str


@dataclass(frozen=True)
class Actions:
    """What the apply layer must do, in this order: ensure, delete, create."""

    ensure: tuple[dict[str, Any], ...] = ()  # create, or update if it differs (ConfigMap, Services)
    delete: tuple[PodDeletion, ...] = ()
    create: tuple[dict[str, Any], ...] = ()  # create if absent (pods)
    events: tuple[EventSpec, ...] = ()
    # Gang scheduling: the PodGroup, ensured before any pod is created; no worker pod is
    # created in a pass where it could not be (a worker outside its group would be placed
    # alone, or never: exactly what the group is for).
    pod_group: dict[str, Any] | None = None
    remove: tuple[ObjectRef, ...] = ()  # deleted (absent is fine)
    # Kueue: the job's Workload to create (or whose `active` to set), ensured first: no pod
    # is created in a pass where it could not be; and a merge patch of its status (the quota
    # given back after an eviction, or Finished).
    workload: dict[str, Any] | None = None
    # and rewrite its podSets and queueName (written for an earlier spec or queue label; only
    # while it holds no quota)
    workload_rewrite: bool = False
    workload_status: dict[str, Any] | None = None
    workload_name: str = ""
    # A merge patch of the Workload's metadata that removes the resource-in-use finalizer
    # (the Workload Finished or being deleted, and no pod of the job running any more), or
    # adds it (a Workload holding quota without it, written before the operator set it).
    workload_finalizer: dict[str, Any] | None = None
    # Set the existing Workload's `active` false (the job's spec became invalid: no Workload
    # can be built, and the one admitted must give its quota back).
    workload_deactivate: bool = False
    # Not an action: Kueue's side of the job waits for its pods to be gone (the quota given
    # back, the Workload deleted or its finalizer removed), so the handler runs the next pass
    # when one is deleted, not a reconcile interval later (handlers.workloads).
    await_pods_gone: bool = False

    @property
    def empty(self) -> bool:
        return not (
            self.ensure or self.delete or self.create or self.pod_group or self.remove
            or self.workload or self.workload_status or self.workload_deactivate
            or self.workload_finalizer
        )  # fmt: skip
