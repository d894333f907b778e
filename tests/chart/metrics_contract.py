"""The metric names the chart's alerts and dashboards may use: read from the one contract
module (`finetune_operator.api.metricnames`) that the trainer and the operator export from, and
that docs/metrics.md must document."""

from __future__ import annotations

from typing import Final

from finetune_operator.api import metricnames as mn

COUNTER: Final = mn.COUNTER
GAUGE: Final = mn.GAUGE
HISTOGRAM: Final = mn.HISTOGRAM

TRAINER_METRICS: Final = {m.name: m.type for m in mn.TRAINER_METRICS}
OPERATOR_METRICS: Final = {m.name: m.type for m in mn.OPERATOR_METRICS}
DESIGN_METRICS: Final = {**TRAINER_METRICS, **OPERATOR_METRICS}


def queryable_series() -> frozenset[str]:
    """Series names a query may select: histograms only through _bucket, _sum and _count."""
    names: set[str] = set()
    for name, kind in DESIGN_METRICS.items():
        if kind == HISTOGRAM:
            names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)
    return frozenset(names)
