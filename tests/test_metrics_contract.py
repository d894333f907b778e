"""The trainer and the operator export exactly the metrics docs/metrics.md documents (the
contract the chart's alerts and dashboard are checked against), with the documented types."""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry

from finetune_operator import metrics as operator_metrics
from finetune_trainer.metrics import TrainerMetrics
from tests.chart.metrics_contract import COUNTER, OPERATOR_METRICS, TRAINER_METRICS


def _exported(registry: CollectorRegistry, prefix: str) -> dict[str, str]:
    # prometheus_client names a counter's family without its _total suffix.
    return {
        (f.name + "_total" if f.type == COUNTER else f.name): f.type
        for f in registry.collect()
        if f.name.startswith(prefix)
    }


def test_trainer_exports_the_contract() -> None:
    m = TrainerMetrics(job="j", rank=0, device=torch.device("cpu"), restarts=0, total_steps=10)
    assert _exported(m.registry, "finetune_trainer_") == TRAINER_METRICS


def test_operator_exports_the_contract() -> None:
    assert _exported(operator_metrics.REGISTRY, "finetune_operator_") == OPERATOR_METRICS
