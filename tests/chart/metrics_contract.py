"""The metric names of DESIGN.md §6 (trainer) and §8 (operator): the contract dashboards and
alerts may use, and docs/metrics.md must document. Types are the ones docs/metrics.md fixes."""

from __future__ import annotations

from typing import Final

COUNTER: Final = "counter"
GAUGE: Final = "gauge"
HISTOGRAM: Final = "histogram"

TRAINER_METRICS: Final = {
    "finetune_trainer_step": GAUGE,
    "finetune_trainer_total_steps": GAUGE,
    "finetune_trainer_step_duration_seconds": HISTOGRAM,
    "finetune_trainer_compute_duration_seconds": HISTOGRAM,
    "finetune_trainer_wait_duration_seconds": HISTOGRAM,
    "finetune_trainer_loss": GAUGE,
    "finetune_trainer_tokens_total": COUNTER,
    "finetune_trainer_checkpoint_blocking_seconds": HISTOGRAM,
    "finetune_trainer_checkpoint_save_duration_seconds": HISTOGRAM,
    "finetune_trainer_checkpoint_stall_seconds": HISTOGRAM,
    "finetune_trainer_checkpoint_failures_total": COUNTER,
    "finetune_trainer_last_failed_checkpoint_step": GAUGE,
    "finetune_trainer_last_checkpoint_step": GAUGE,
    "finetune_trainer_last_checkpoint_timestamp_seconds": GAUGE,
    "finetune_trainer_elastic_restarts": GAUGE,
    "finetune_trainer_peak_memory_bytes": GAUGE,
}

OPERATOR_METRICS: Final = {
    "finetune_operator_jobs": GAUGE,
    "finetune_operator_reconcile_duration_seconds": HISTOGRAM,
    "finetune_operator_reconcile_errors_total": COUNTER,
    "finetune_operator_evictions_total": COUNTER,
    "finetune_operator_straggler_ratio": GAUGE,
    "finetune_operator_pod_replacements_total": COUNTER,
}

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
