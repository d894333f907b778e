"""The message for a PodGroup or Workload the operator cannot write: what to do, by status
(one function, reconcile/child_errors.describe_child_error, with each child's advice)."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from finetune_operator.reconcile.child_errors import (
    POD_GROUP_ADVICE,
    WORKLOAD_ADVICE,
    ChildErrorAdvice,
    describe_child_error,
)

POD_GROUP = {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "metadata": {"name": "qs"}}
WORKLOAD = {"apiVersion": "kueue.x-k8s.io/v1beta2", "metadata": {"name": "qs"}}
REASONS = {404: "Not Found", 403: "Forbidden", 500: "Internal Server Error"}


@pytest.mark.parametrize(
    ("obj", "advice", "status", "message"),
    [
        (POD_GROUP, POD_GROUP_ADVICE, 404,
         "PodGroup qs (HTTP 404 Not Found): the API server does not serve "
         "podgroups.scheduling.x-k8s.io/v1alpha1: install the gang scheduler that defines the "
         "CRD podgroups.scheduling.x-k8s.io, or unset spec.resources.gangScheduling; worker "
         "pods wait until it exists"),
        (POD_GROUP, POD_GROUP_ADVICE, 403,
         "PodGroup qs (HTTP 403 Forbidden): the operator may not manage "
         "podgroups.scheduling.x-k8s.io: add its scheduler to the chart value "
         "gangScheduling.schedulers; worker pods wait until it may"),
        (POD_GROUP, POD_GROUP_ADVICE, 500,
         "PodGroup qs (HTTP 500 Internal Server Error); worker pods wait until it is created"),
        (WORKLOAD, WORKLOAD_ADVICE, 404,
         "Workload qs (HTTP 404 Not Found): the API server does not serve "
         "workloads.kueue.x-k8s.io/v1beta2: install Kueue (v0.15 or later), or remove the "
         "job's kueue.x-k8s.io/queue-name label; the job waits until it exists"),
        (WORKLOAD, WORKLOAD_ADVICE, 403,
         "Workload qs (HTTP 403 Forbidden): the operator may not manage "
         "workloads.kueue.x-k8s.io: set the chart value kueue.enabled=true; the job waits "
         "until it may"),
        (WORKLOAD, WORKLOAD_ADVICE, 500,
         "Workload qs (HTTP 500 Internal Server Error); the job waits until it is written"),
    ],
    ids=["podgroup-404", "podgroup-403", "podgroup-500", "workload-404", "workload-403",
         "workload-500"],
)  # fmt: skip
def test_the_message_says_what_to_do(
    obj: dict[str, object], advice: ChildErrorAdvice, status: int, message: str
) -> None:
    err = ApiException(status=status, reason=REASONS[status])
    assert describe_child_error(obj, err, advice) == message
