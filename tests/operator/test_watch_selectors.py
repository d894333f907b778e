"""The operator's watches of pods and Workloads are filtered by the API server (kopf's
settings.watching.label_selectors), not only by its handlers' `labels=` filter, which kopf
applies after the API server has streamed every pod of the watched namespaces to it."""

from __future__ import annotations

from typing import Any

import kopf
import pytest

from finetune_operator.api.constants import GROUP, LABEL_JOB, PLURAL, VERSION
from finetune_operator.handlers.jobs import configure
from finetune_operator.resources.workload import KUEUE_GROUP, KUEUE_VERSION, WORKLOAD_PLURAL

PODS = kopf.Resource("", "v1", "pods", kind="Pod", namespaced=True)
WORKLOADS = kopf.Resource(KUEUE_GROUP, KUEUE_VERSION, WORKLOAD_PLURAL, kind="Workload", namespaced=True)  # fmt: skip
JOBS = kopf.Resource(GROUP, VERSION, PLURAL, kind="FineTuneJob", namespaced=True)
# Same name, other groups: left alone (metrics.k8s.io serves PodMetrics as "pods").
POD_METRICS = kopf.Resource("metrics.k8s.io", "v1beta1", "pods", kind="PodMetrics", namespaced=True)  # fmt: skip


@pytest.fixture
def settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    memo: dict[str, Any] = {"cluster": object(), "planner": object()}  # no API client, no port
    configure(settings=settings, memo=kopf.Memo(memo))
    return settings


def test_pods_and_workloads_are_watched_by_the_job_label(settings: kopf.OperatorSettings) -> None:
    selectors = settings.watching.label_selectors
    assert list(selectors.collect(PODS)) == [LABEL_JOB]
    assert list(selectors.collect(WORKLOADS)) == [LABEL_JOB]


def test_the_jobs_themselves_and_other_pods_resources_are_not_filtered(
    settings: kopf.OperatorSettings,
) -> None:
    selectors = settings.watching.label_selectors
    assert list(selectors.collect(JOBS)) == [] and list(selectors.collect(POD_METRICS)) == []
