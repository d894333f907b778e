"""The job's PodGroup and the worker pods' membership in it (gang scheduling), for the two
schedulers that implement it: scheduler-plugins' Coscheduling and Volcano.

Only the worker pods form the gang: the rendezvous pod is small, lands on any node, and the
workers cannot start without it, so it must never wait for GPUs. `minMember` is the elastic
minimum (resources.minNodes, else the planned nodes): torchrun trains with that many, so
binding fewer would hold GPUs idle, and waiting for more than that would be stricter than the
job. Pods above the minimum join the group and are placed as they fit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from finetune_operator.api.resources_spec import GangSchedulingSpec
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.resources.common import Owner, object_meta


@dataclass(frozen=True)
class GangApi:
    """What one gang scheduler reads: its PodGroup kind, and how a pod names its group."""

    group: str
    version: str
    default_scheduler_name: str
    pod_label: str | None = None  # the pod belongs to the group this label names...
    pod_annotation: str | None = None  # ...or this annotation names

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @property
    def crd_name(self) -> str:
        return f"{PLURAL}.{self.group}"


KIND = "PodGroup"
PLURAL = "podgroups"
GANG_APIS: dict[str, GangApi] = {
    # kubernetes-sigs/scheduler-plugins, apis/scheduling/v1alpha1 (PodGroupLabel). The plugin
    # runs in a second scheduler; its upstream chart names that scheduler as below.
    "coscheduling": GangApi(
        "scheduling.x-k8s.io",
        "v1alpha1",
        "scheduler-plugins-scheduler",
        pod_label="scheduling.x-k8s.io/pod-group",
    ),
    # volcano.sh/apis, pkg/apis/scheduling/v1beta1 (KubeGroupNameAnnotationKey).
    "volcano": GangApi(
        "scheduling.volcano.sh",
        "v1beta1",
        "volcano",
        pod_annotation="scheduling.k8s.io/group-name",
    ),
}
ROLE_GANG = "gang"


def gang_of(spec: FineTuneJobSpec) -> tuple[GangSchedulingSpec, GangApi] | None:
    """The job's gang scheduling and its scheduler's API; None when it is off."""
    gang = spec.resources.gang_scheduling
    if gang is None or not gang.enabled:
        return None
    return gang, GANG_APIS[gang.scheduler]


def pod_group_name(owner: Owner) -> str:
    # One group per job; a PodGroup has its own kind, so the job's name cannot collide.
    return owner.name


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")


def scale_quantity(value: str, times: int) -> str:
    """`value` (a Kubernetes quantity) times `times`, in the same unit: "500m" x 3 = "1500m",
    "64Gi" x 2 = "128Gi", "1e3" x 2 = "2000". A form it cannot read is refused, not guessed."""
    match = _QUANTITY.match(value.strip())
    if match is None:
        raise ValueError(f"cannot scale quantity {value!r}")
    try:
        number = Decimal(match.group(1)) * times
    except InvalidOperation:
        raise ValueError(f"cannot scale quantity {value!r}") from None
    text = format(number.normalize(), "f")
    return f"{text}{match.group(2)}"


def min_resources(requests: dict[str, str], members: int) -> dict[str, str]:
    """What `members` worker pods request together: the PodGroup's minResources, which
    Coscheduling's PreFilter checks against free capacity and Volcano's enqueue action
    against the queue, so a group that cannot fit does not even start to be placed. A request
    it cannot read is left out (the API server refuses it on the pod, with the field named):
    minResources is an optimisation, the gang holds without it."""
    out: dict[str, str] = {}
    for name, value in sorted(requests.items()):
        try:
            out[name] = scale_quantity(value, members)
        except ValueError:
            continue
    return out


def build_pod_group(
    owner: Owner, spec: FineTuneJobSpec, min_member: int, requests: dict[str, str]
) -> dict[str, Any] | None:
    """The job's PodGroup (None when gang scheduling is off). `requests`: one worker pod's."""
    found = gang_of(spec)
    if found is None:
        return None
    gang, api = found
    body: dict[str, Any] = {"minMember": min_member}
    if requests:
        body["minResources"] = min_resources(requests, min_member)
    if gang.schedule_timeout_seconds is not None:
        body["scheduleTimeoutSeconds"] = gang.schedule_timeout_seconds
    if gang.queue is not None:
        body["queue"] = gang.queue
    if api.group == GANG_APIS["volcano"].group and spec.resources.priority_class_name:
        # Volcano orders groups by the group's priority, not its pods'.
        body["priorityClassName"] = spec.resources.priority_class_name
    return {
        "apiVersion": api.api_version,
        "kind": KIND,
        "metadata": object_meta(owner, pod_group_name(owner), ROLE_GANG),
        "spec": body,
    }


def join_gang(pod: dict[str, Any], owner: Owner, spec: FineTuneJobSpec) -> dict[str, Any]:
    """`pod` (a worker) as a member of the job's PodGroup: the scheduler's name, and the label
    or annotation that names the group. Unchanged when gang scheduling is off."""
    found = gang_of(spec)
    if found is None:
        return pod
    gang, api = found
    meta = pod["metadata"]
    if api.pod_label:
        meta["labels"] = {**meta.get("labels", {}), api.pod_label: pod_group_name(owner)}
    if api.pod_annotation:
        meta["annotations"] = {
            **meta.get("annotations", {}),
            api.pod_annotation: pod_group_name(owner),
        }
    pod["spec"]["schedulerName"] = gang.scheduler_name or api.default_scheduler_name
    return pod
