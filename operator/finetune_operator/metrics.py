"""The operator's own Prometheus metrics (DESIGN.md §8), on a private registry.

A private registry keeps the process/platform collectors and any library's default metrics out
of the operator's endpoint, and lets tests read exact values without global state leaking.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from time import perf_counter

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from finetune_operator.api.constants import PHASES

# No `<name>_created` gauges next to each counter/histogram: they double the series count and
# no dashboard or alert reads them. (Process-wide switch of prometheus-client; the operator
# process exports nothing else.)
disable_created_metrics()  # type: ignore[no-untyped-call]
REGISTRY = CollectorRegistry(auto_describe=True)

JOBS = Gauge(
    "finetune_operator_jobs",
    "FineTuneJobs known to this operator, by phase.",
    ["state"],
    registry=REGISTRY,
)
RECONCILE_DURATION = Histogram(
    "finetune_operator_reconcile_duration_seconds",
    "Wall time of one reconcile pass of one FineTuneJob (decide, apply, patch).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    "finetune_operator_reconcile_errors",
    "Reconcile passes that failed (API errors, planner errors) and will be retried.",
    registry=REGISTRY,
)
EVICTIONS = Counter(
    "finetune_operator_evictions",
    "Straggler pods evicted, per FineTuneJob.",
    ["finetunejob"],
    registry=REGISTRY,
)
STRAGGLER_RATIO = Gauge(
    "finetune_operator_straggler_ratio",
    "Per-rank compute time over the cross-rank median in the last detection window.",
    ["finetunejob", "rank"],
    registry=REGISTRY,
)
POD_REPLACEMENTS = Counter(
    "finetune_operator_pod_replacements",
    "Failed pods replaced (job-level restarts), per FineTuneJob.",
    ["finetunejob"],
    registry=REGISTRY,
)

# Per-job series are labelled `finetunejob=<name>`, the same value the trainer's own metrics
# carry, so dashboards can join them; namespaces are not in it (see docs).
# Which phase each job (by namespace/name) was counted in, so the per-phase gauge is exact without listing jobs.
_phases: dict[str, str] = {}
# Ranks with a straggler-ratio series, per job: needed to delete exactly those series.
_ranks: dict[str, set[str]] = {}

for _phase in PHASES:
    JOBS.labels(state=_phase).set(0)  # every state present from the start: alerts see zeros


def set_job_phase(job: str, phase: str | None) -> None:
    """Count `job` in `phase` (None: forget it, e.g. once the job is deleted)."""
    before = _phases.pop(job, None)
    if before is not None:
        JOBS.labels(state=before).dec()
    if phase is not None:
        _phases[job] = phase
        JOBS.labels(state=phase).inc()


def record_replacements(job: str, count: int) -> None:
    if count > 0:
        POD_REPLACEMENTS.labels(finetunejob=job).inc(count)


def record_eviction(job: str) -> None:
    EVICTIONS.labels(finetunejob=job).inc()


def set_straggler_ratio(job: str, rank: int, ratio: float) -> None:
    _ranks.setdefault(job, set()).add(str(rank))
    STRAGGLER_RATIO.labels(finetunejob=job, rank=str(rank)).set(ratio)


def forget_job_series(job: str) -> None:
    """Delete a finished job's per-job series: bounded cardinality over many jobs."""
    for metric in (EVICTIONS, POD_REPLACEMENTS):
        with suppress(KeyError):
            metric.remove(job)
    for rank in _ranks.pop(job, set()):
        with suppress(KeyError):
            STRAGGLER_RATIO.remove(job, rank)


@contextmanager
def timed_reconcile() -> Iterator[None]:
    """Observe the pass's duration; count it as an error if it raised."""
    start = perf_counter()
    try:
        yield
    except BaseException:
        RECONCILE_ERRORS.inc()
        raise
    finally:
        RECONCILE_DURATION.observe(perf_counter() - start)


def serve_metrics(port: int, addr: str = "0.0.0.0") -> None:
    """Serve REGISTRY on http://addr:port/metrics in a daemon thread."""
    start_http_server(port, addr=addr, registry=REGISTRY)


def tracked_jobs() -> dict[str, str]:
    """namespace/name → phase of every job this operator counts."""
    return dict(_phases)
