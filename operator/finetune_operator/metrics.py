"""The operator's own Prometheus metrics (DESIGN.md §8), on a private registry.

A private registry keeps the process/platform collectors and any library's default metrics out
of the operator's endpoint, and lets tests read exact values without global state leaking.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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

from finetune_operator.api import metricnames as mn
from finetune_operator.api.constants import PHASES

# No `<name>_created` gauges next to each counter/histogram: they double the series count and
# no dashboard or alert reads them. (Process-wide switch of prometheus-client; the operator
# process exports nothing else.)
disable_created_metrics()  # type: ignore[no-untyped-call]
REGISTRY = CollectorRegistry(auto_describe=True)


def _labels(m: mn.Metric) -> list[str]:
    return list(m.labels)


JOBS = Gauge(
    mn.OPERATOR_JOBS.family, mn.OPERATOR_JOBS.help, _labels(mn.OPERATOR_JOBS), registry=REGISTRY
)
RECONCILE_DURATION = Histogram(
    mn.OPERATOR_RECONCILE_DURATION.family,
    mn.OPERATOR_RECONCILE_DURATION.help,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    mn.OPERATOR_RECONCILE_ERRORS.family, mn.OPERATOR_RECONCILE_ERRORS.help, registry=REGISTRY
)
EVICTIONS = Counter(
    mn.OPERATOR_EVICTIONS.family,
    mn.OPERATOR_EVICTIONS.help,
    _labels(mn.OPERATOR_EVICTIONS),
    registry=REGISTRY,
)
HANGS = Counter(
    mn.OPERATOR_HANGS.family, mn.OPERATOR_HANGS.help, _labels(mn.OPERATOR_HANGS), registry=REGISTRY
)
STRAGGLER_RATIO = Gauge(
    mn.OPERATOR_STRAGGLER_RATIO.family,
    mn.OPERATOR_STRAGGLER_RATIO.help,
    _labels(mn.OPERATOR_STRAGGLER_RATIO),
    registry=REGISTRY,
)
RESTARTS = Counter(
    mn.OPERATOR_RESTARTS.family,
    mn.OPERATOR_RESTARTS.help,
    _labels(mn.OPERATOR_RESTARTS),
    registry=REGISTRY,
)
FORGIVEN_RESTARTS = Counter(
    mn.OPERATOR_FORGIVEN_RESTARTS.family,
    mn.OPERATOR_FORGIVEN_RESTARTS.help,
    _labels(mn.OPERATOR_FORGIVEN_RESTARTS),
    registry=REGISTRY,
)
PREEMPTIONS = Counter(
    mn.OPERATOR_PREEMPTIONS.family,
    mn.OPERATOR_PREEMPTIONS.help,
    _labels(mn.OPERATOR_PREEMPTIONS),
    registry=REGISTRY,
)

# Per-job series carry `namespace` and `finetunejob` (the job key): two jobs named alike in two
# namespaces keep apart. `finetunejob` is the value the trainer's own series carry, so
# dashboards join them on (namespace, finetunejob).
# Which phase each job (namespace/name) was counted in, so the per-phase gauge is exact.
_phases: dict[str, str] = {}
# Ranks with a straggler-ratio series, per job key: needed to delete exactly those series.
_ranks: dict[tuple[str, str], set[str]] = {}

for _phase in PHASES:
    JOBS.labels(state=_phase).set(0)  # every state present from the start: alerts see zeros


def set_job_phase(job: str, phase: str | None) -> None:
    """Count `job` (namespace/name) in `phase` (None: forget it, e.g. once it is deleted)."""
    before = _phases.pop(job, None)
    if before is not None:
        JOBS.labels(state=before).dec()
    if phase is not None:
        _phases[job] = phase
        JOBS.labels(state=phase).inc()


def record_restarts(namespace: str, name: str, change: int, taken_back: int = 0) -> None:
    """A pass's change of status.restarts, with the restarts it took back after a node loss
    (`taken_back`: reconcile/forgiveness.taken_back) apart: restarts counted and taken back
    each on its own counter. One pass may do both (a failure counted while a lost node's
    round is taken back), which the net change alone hides; a decrease no ledger explains is
    taken back all the same."""
    counted = change + taken_back
    forgiven = max(taken_back, -change)
    if counted > 0:
        RESTARTS.labels(namespace=namespace, finetunejob=name).inc(counted)
    if forgiven > 0:
        FORGIVEN_RESTARTS.labels(namespace=namespace, finetunejob=name).inc(forgiven)


def record_preemptions(namespace: str, name: str, count: int) -> None:
    if count > 0:
        PREEMPTIONS.labels(namespace=namespace, finetunejob=name).inc(count)


def record_evictions(namespace: str, name: str, count: int) -> None:
    if count > 0:
        EVICTIONS.labels(namespace=namespace, finetunejob=name).inc(count)


def record_hangs(namespace: str, name: str, count: int) -> None:
    if count > 0:
        HANGS.labels(namespace=namespace, finetunejob=name).inc(count)


def set_straggler_ratios(namespace: str, name: str, ratios: Mapping[int, float]) -> None:
    """The latest window's ratio per rank; ranks no longer reported lose their series."""
    key = (namespace, name)
    now = {str(r) for r in ratios}
    for gone in _ranks.get(key, set()) - now:
        with suppress(KeyError):
            STRAGGLER_RATIO.remove(namespace, name, gone)
    _ranks[key] = now
    for rank, ratio in ratios.items():
        STRAGGLER_RATIO.labels(namespace=namespace, finetunejob=name, rank=str(rank)).set(ratio)


def forget_job_series(namespace: str, name: str) -> None:
    """Delete a finished job's per-job series: bounded cardinality over many jobs."""
    for metric in (EVICTIONS, RESTARTS, FORGIVEN_RESTARTS, PREEMPTIONS, HANGS):
        with suppress(KeyError):
            metric.remove(namespace, name)
    for rank in _ranks.pop((namespace, name), set()):
        with suppress(KeyError):
            STRAGGLER_RATIO.remove(namespace, name, rank)


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
