"""A worker pod no node has room for: the job names the request and the spec field behind it
(reconcile/unschedulable.py, observed.py)."""

from __future__ import annotations

from typing import Any

import pytest

from finetune_operator.api.constants import LABEL_JOB, LABEL_ROLE, LABEL_WORKER_INDEX
from finetune_operator.reconcile.observed import observe_pod
from finetune_operator.reconcile.unschedulable import explain_unschedulable, short_resources

REQUESTS = {"memory": "512Gi", "ephemeral-storage": "32Gi", "cpu": "8", "nvidia.com/gpu": "8"}
PREEMPTION = (
    " preemption: 0/4 nodes are available: 4 No preemption victims found for incoming pod.."
)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            "0/4 nodes are available: 4 Insufficient ephemeral-storage." + PREEMPTION,
            "ephemeral-storage 32Gi (spec.dataset.cacheSizeLimit)",
        ),
        (
            "0/3 nodes are available: 1 Insufficient cpu, 2 Insufficient memory.",
            "cpu 8 (spec.resources.cpu), memory 512Gi (spec.resources.memory)",
        ),
        (
            "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
            "nvidia.com/gpu 8 (spec.resources.gpusPerNode",
        ),
    ],
)
def test_names_each_short_request_with_its_amount_and_field(message: str, expected: str) -> None:
    hint = explain_unschedulable(message, REQUESTS)
    assert hint is not None and expected in hint
    assert hint.startswith("no node has room for the worker's ")


def test_pod_slots_and_other_reasons() -> None:
    assert explain_unschedulable("0/2 nodes are available: 2 Too many pods.", REQUESTS) is None
    # a selector or taint is no request to lower: the scheduler's own words stand alone
    selector = "0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector."
    assert explain_unschedulable(selector, REQUESTS) is None
    assert short_resources(
        "0/5 nodes are available: 2 Insufficient cpu, 3 Insufficient cpu. "
        "The pod group needs 2 pods at once"
    ) == ["cpu"]


def _worker(message: str, resources: dict[str, Any], role: str = "worker") -> dict[str, Any]:
    return {
        "metadata": {
            "name": "j-worker-0",
            "uid": "u0",
            "labels": {LABEL_JOB: "j", LABEL_ROLE: role, LABEL_WORKER_INDEX: "0"},
        },
        "spec": {"containers": [{"name": "trainer", "resources": resources}]},
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": message}
            ],
        },
    }  # fmt: skip


def test_a_worker_pod_says_which_request_to_change_before_the_schedulers_words() -> None:
    message = "0/4 nodes are available: 4 Insufficient memory." + PREEMPTION
    raw = _worker(message, {"requests": {"memory": "512Gi"}, "limits": {"memory": "512Gi"}})
    blocked = observe_pod(raw).blocked
    assert blocked is not None
    assert blocked.startswith(
        "Unschedulable: no node has room for the worker's memory 512Gi (spec.resources.memory)"
    )
    assert "scheduler: 0/4 nodes are available: 4 Insufficient memory." in blocked
    # the rendezvous pod's requests are the operator's own, not a spec field
    other = observe_pod(_worker(message, {"requests": {"memory": "256Mi"}}, role="rendezvous"))
    assert other.blocked == f"Unschedulable: {message}"
