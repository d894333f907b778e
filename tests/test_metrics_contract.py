"""The trainer and the operator export exactly the metrics of the one contract module
(`finetune_operator.api.metricnames`, which docs/metrics.md and the chart are checked against),
with the declared types, and every declared series is set by a code path that runs."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil

import torch
from prometheus_client import CollectorRegistry, generate_latest

from finetune_operator import handlers
from finetune_operator import metrics as operator_metrics
from finetune_operator.api import metricnames as mn
from finetune_operator.reconcile.progress import parse_own_rounds, parse_round
from finetune_trainer.metrics import StepStats, TrainerMetrics
from tests.chart.metrics_contract import COUNTER, OPERATOR_METRICS, TRAINER_METRICS


def _exported(registry: CollectorRegistry, prefix: str) -> dict[str, str]:
    # prometheus_client names a counter's family without its _total suffix.
    return {
        (f.name + "_total" if f.type == COUNTER else f.name): f.type
        for f in registry.collect()
        if f.name.startswith(prefix)
    }


def test_trainer_exports_the_contract() -> None:
    m = TrainerMetrics(job="j", rank=0, device=torch.device("cpu"), reforms=0, total_steps=10)
    assert _exported(m.registry, "finetune_trainer_") == TRAINER_METRICS


def test_operator_exports_the_contract() -> None:
    assert _exported(operator_metrics.REGISTRY, "finetune_operator_") == OPERATOR_METRICS


def test_labels_are_the_declared_ones_and_never_job() -> None:
    for m in mn.ALL_METRICS:
        assert "job" not in m.labels, m.name
    per_job = (mn.OPERATOR_EVICTIONS, mn.OPERATOR_STRAGGLER_RATIO, mn.OPERATOR_HANGS)
    for m in (*per_job, mn.OPERATOR_RESTARTS, mn.OPERATOR_PREEMPTIONS):
        assert m.labels[:2] == ("namespace", "finetunejob"), m.name


def test_every_trainer_series_is_set_by_the_loop() -> None:
    """What the loop calls (observe_step, beat, the checkpoint hooks, serve) sets every series
    to a value that means something (a histogram observed, a gauge moved off its zero)."""
    m = TrainerMetrics(
        job="j",
        rank=0,
        device=torch.device("cpu"),
        reforms=1,
        total_steps=10,
        own_rounds=("r1", "r2"),
        round_id="r3",
    )
    m.serve(None, None)
    m.observe_step(StepStats(3, 2.5, 1e-3, 512, 0.3, 0.2, 0.1), world_size=2)
    m.beat()
    # A save: started, returned to the loop, staged, steps run under it, window closed.
    m.checkpoint_save_started()
    m.checkpoint_save_returned(3, 0.05)
    m.checkpoint_staging_waited(0.01)
    for seconds in (0.3, 0.5, 0.3):
        m.observe_step_time(seconds)
    m.checkpoint_window_closed()
    m.observe_checkpoint_committed(3, 1.5)
    m.observe_checkpoint_failed(4)
    m.observe_resume(3, [5])
    values: dict[str, float] = {}
    for family in m.registry.collect():
        for s in family.samples:
            if s.name.endswith("_count") or not s.name.endswith(("_bucket", "_sum", "_created")):
                values[s.name.removesuffix("_count")] = s.value
    unset = [x.name for x in mn.TRAINER_METRICS if not values.get(x.name)]
    assert not unset, f"declared but never set: {unset}"
    # The operator reads the launcher's rounds back from the page (its restart ledger's feed).
    page = generate_latest(m.registry).decode()
    assert parse_own_rounds(page) == {"r1", "r2"}
    assert parse_round(page) == "r3"


def _metric_objects() -> dict[str, str]:
    """Operator metric variable in finetune_operator.metrics → contract name."""
    out = {}
    for var, obj in vars(operator_metrics).items():
        describe = getattr(obj, "describe", None)
        if describe is not None and var.isupper():
            out[var] = describe()[0].name
    return out


def test_every_operator_series_is_set_from_the_handlers() -> None:
    """Each operator metric is changed by a function of finetune_operator.metrics that the
    kopf handlers call (a series only tests set would be a dead panel and a silent alert)."""
    objects = _metric_objects()
    tree = ast.parse(inspect.getsource(operator_metrics))
    setters: dict[str, set[str]] = {}  # function → metric variables it touches
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in objects}
        setters[fn.name] = names
    modules = [importlib.import_module(f"{handlers.__name__}.{m.name}")
               for m in pkgutil.iter_modules(handlers.__path__)]  # fmt: skip
    trees = [ast.parse(inspect.getsource(m)) for m in modules]
    called = {
        n.func.attr
        for tree in trees
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "metrics"
    }
    set_from_handlers = {objects[v] for fn in called for v in setters.get(fn, set())}
    # Module level: the per-state gauge starts at zero for every state.
    declared = {m.family for m in mn.OPERATOR_METRICS}
    assert declared <= set_from_handlers | {mn.OPERATOR_JOBS.family}, declared - set_from_handlers
    assert "set_job_phase" in called and "timed_reconcile" in called
