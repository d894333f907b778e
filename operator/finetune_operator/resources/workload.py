"""The job's Kueue Workload, and what an admission puts into its worker pods (pure).

A FineTuneJob with the `kueue.x-k8s.io/queue-name` label is admitted by Kueue the way an
external job controller integrates with it (Kueue's `integrations.externalFrameworks`): the
operator writes one `kueue.x-k8s.io/v1beta2` Workload per job, owned by the job, with one
podSet of worker pods; Kueue reserves quota for it and writes `status.admission`; the operator
creates workers only once it is admitted, as many as admitted, with the flavor's node labels
and tolerations. The rendezvous pod is not in the podSet: it requests no accelerator, and it
is created only with the workers, so nothing runs before admission.

v1beta2 is the version Kueue serves and stores since v0.15 (v1beta1 is deprecated there and
converted); the fields used here (podSets[].count/minCount/template, queueName, active,
status.admission.podSetAssignments, the QuotaReserved/Admitted/Evicted/Finished conditions)
are read from `apis/kueue/v1beta2/workload_types.go` in kubernetes-sigs/kueue.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Final

from finetune_operator.api.constants import LABEL_WORKER_INDEX
from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.resources.common import Owner, object_meta
from finetune_operator.resources.worker import build_worker_pod, node_range

KUEUE_GROUP: Final = "kueue.x-k8s.io"
KUEUE_VERSION: Final = "v1beta2"
KUEUE_API_VERSION: Final = f"{KUEUE_GROUP}/{KUEUE_VERSION}"
WORKLOAD_KIND: Final = "Workload"
WORKLOAD_PLURAL: Final = "workloads"
FLAVOR_PLURAL: Final = "resourceflavors"
# Kueue's own convention for "this job is queued in that LocalQueue" (every integration).
QUEUE_LABEL: Final = f"{KUEUE_GROUP}/queue-name"
# A Kueue WorkloadPriorityClass for the job (Kueue's convention, as for its own integrations);
# without it the worker pods' PriorityClass (spec.resources.priorityClassName) is used.
PRIORITY_LABEL: Final = f"{KUEUE_GROUP}/priority-class"
POD_SET: Final = "workers"
# Kueue's job reconciler puts it on every Workload it creates (ResourceInUseFinalizerName):
# a Workload deleted while its job's pods still run stays (its quota counted) until the job
# controller has stopped them and removes it. The operator does the same for its jobs.
RESOURCE_IN_USE: Final = f"{KUEUE_GROUP}/resource-in-use"
ROLE_WORKLOAD = "workload"
# PodTemplateSpec.metadata in a Workload may hold only labels and annotations.
_TEMPLATE_META = ("labels", "annotations")


def queue_name_of(labels: dict[str, str] | None) -> str | None:
    """The LocalQueue a job opted into (its queue-name label), None when it did not."""
    name = (labels or {}).get(QUEUE_LABEL, "").strip()
    return name or None


@dataclass(frozen=True)
class PriorityRef:
    """The priority class a Workload names (v1beta2 `priorityClassRef`)."""

    group: str
    kind: str
    name: str

    @property
    def plural(self) -> str:
        return "workloadpriorityclasses" if self.group == KUEUE_GROUP else "priorityclasses"


def priority_ref(
    labels: dict[str, str] | None, priority_class_name: str | None
) -> PriorityRef | None:
    """The job's Workload priority class: its priority-class label (a WorkloadPriorityClass),
    else its pods' PriorityClass, else none (Kueue's default, 0)."""
    label = (labels or {}).get(PRIORITY_LABEL, "").strip()
    if label:
        return PriorityRef(KUEUE_GROUP, "WorkloadPriorityClass", label)
    if priority_class_name:
        return PriorityRef("scheduling.k8s.io", "PriorityClass", priority_class_name)
    return None


def workload_name(owner: Owner) -> str:
    # One Workload per job; its own kind, so the job's name cannot collide.
    return owner.name


def worker_template(owner: Owner, spec: FineTuneJobSpec, plan: Plan) -> dict[str, Any]:
    """The podSet's template: a worker pod as the operator builds it (so the Workload's
    requests are the pods' requests by construction), without what differs per pod (its
    name, index label and host name), without the nodes excluded after a failure, and
    without the lost-node tolerations: what the API server gives every pod anyway, only
    shorter (no part in a flavor's choice), and a Workload written before the operator added
    them must not read as another pod set (a stale Workload stops a running job)."""
    pod = build_worker_pod(owner, spec, plan, 0, node_loss=False)
    meta = {k: copy.deepcopy(v) for k, v in pod["metadata"].items() if k in _TEMPLATE_META}
    meta.get("labels", {}).pop(LABEL_WORKER_INDEX, None)
    pod_spec = copy.deepcopy(pod["spec"])
    pod_spec.pop("hostname", None)
    return {"metadata": meta, "spec": pod_spec}


def build_workload(
    owner: Owner,
    spec: FineTuneJobSpec,
    plan: Plan,
    queue: str,
    priority: tuple[PriorityRef, int] | None = None,
) -> dict[str, Any]:
    """The job's Workload. `count` is the planned number of worker pods; `minCount` the
    elastic minimum when it is lower (Kueue's partial admission: it may admit any count in
    between, and torchrun trains on that many). `active` is false while the job is
    suspended: Kueue then evicts it and releases its quota, and requeues it once true.
    `priority`: the class and its value, which the Workload must carry together (the writer
    resolves the value, as Kueue's job integrations do; Kueue orders and preempts by it)."""
    low, _ = node_range(spec, plan)
    pod_set: dict[str, Any] = {
        "name": POD_SET,
        "count": plan.nodes,
        "template": worker_template(owner, spec, plan),
    }
    if low < plan.nodes:
        pod_set["minCount"] = low
    body: dict[str, Any] = {"queueName": queue, "active": not spec.suspend, "podSets": [pod_set]}
    if priority is not None:
        ref, value = priority
        body["priorityClassRef"] = {"group": ref.group, "kind": ref.kind, "name": ref.name}
        body["priority"] = value
    meta = object_meta(owner, workload_name(owner), ROLE_WORKLOAD)
    meta["finalizers"] = [RESOURCE_IN_USE]
    return {"apiVersion": KUEUE_API_VERSION, "kind": WORKLOAD_KIND, "metadata": meta, "spec": body}


@dataclass(frozen=True)
class Placement:
    """What an admission adds to each worker pod: the assigned ResourceFlavors' node labels
    (as nodeSelector) and tolerations, and an admission check's podSetUpdates, as Kueue's
    own job integrations inject them when they start an admitted job."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    # Where each entry came from ("ResourceFlavor spot", "admission check prov"), keyed by
    # (field, key) with field "nodeSelector", "labels" or "annotations": named in a conflict.
    origins: dict[tuple[str, str], str] = field(default_factory=dict)


def placement_conflict(pod: dict[str, Any], placement: Placement) -> str:
    """Why the admission cannot be applied to the job's `pod` ("" when it can): a key the
    job's pod already sets (nodeSelector, labels, annotations) with another value, which
    Kueue's podset.Merge refuses as a permanent error (the Workload then Finished,
    FailedToStart) rather than let either side win. Tolerations are only ever added (Kueue
    appends those not already there), so they never conflict."""
    spec, meta = pod["spec"], pod["metadata"]
    for what, own, added in (
        ("nodeSelector", spec.get("nodeSelector") or {}, placement.node_selector),
        ("labels", meta.get("labels") or {}, placement.labels),
        ("annotations", meta.get("annotations") or {}, placement.annotations),
    ):
        for key in sorted(set(own) & set(added)):
            if own[key] != added[key]:
                origin = placement.origins.get((what, key), "its admission")
                return (
                    f"{origin} sets {what} {key}={added[key]}, but the job's worker pods have "
                    f"{key}={own[key]}"
                )
    return ""


def place_worker(pod: dict[str, Any], placement: Placement) -> dict[str, Any]:
    """`pod` with the admission's placement added: keys it does not set yet, and tolerations
    not already there (placement_conflict first: a key set both ways is refused, as Kueue's
    podset.Merge does)."""
    spec, meta = pod["spec"], pod["metadata"]
    if placement.node_selector:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **placement.node_selector}
    if placement.tolerations:
        have = list(spec.get("tolerations", []))
        spec["tolerations"] = have + [dict(t) for t in placement.tolerations if t not in have]
    if placement.labels:
        meta["labels"] = {**placement.labels, **meta.get("labels", {})}
    if placement.annotations:
        meta["annotations"] = {**placement.annotations, **meta.get("annotations", {})}
    return pod
