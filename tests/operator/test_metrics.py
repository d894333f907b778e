"""Operator metrics: names and types of the contract, per-phase counts, finished-job cleanup."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from finetune_operator import metrics
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import read_status, status_patch

CONTRACT = {
    "finetune_operator_jobs": "gauge",
    "finetune_operator_reconcile_duration_seconds": "histogram",
    "finetune_operator_reconcile_errors": "counter",  # exposed as ..._total
    "finetune_operator_evictions": "counter",
    "finetune_operator_straggler_ratio": "gauge",
    "finetune_operator_restarts": "counter",
    "finetune_operator_forgiven_restarts": "counter",
    "finetune_operator_preemptions": "counter",
    "finetune_operator_hangs": "counter",
}


def _value(name: str, **labels: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(name, labels)


def test_exported_names_and_types() -> None:
    metrics.record_evictions("ns", "probe", 1)
    metrics.record_hangs("ns", "probe", 1)
    metrics.set_straggler_ratios("ns", "probe", {0: 1.0})
    metrics.record_restarts("ns", "probe", 1)
    metrics.record_preemptions("ns", "probe", 1)
    text = generate_latest(metrics.REGISTRY).decode()
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families == CONTRACT
    assert "finetune_operator_restarts_total{" in text
    assert "job=" not in text.replace("finetunejob=", "")  # never a label called job
    metrics.forget_job_series("ns", "probe")


def test_a_lowered_restart_count_is_counted_as_forgiven_not_subtracted() -> None:
    job = {"namespace": "ns", "finetunejob": "lost"}
    metrics.record_restarts("ns", "lost", 2)
    metrics.record_restarts("ns", "lost", -1)  # a node loss took one back
    metrics.record_restarts("ns", "lost", 0)
    assert _value("finetune_operator_restarts_total", **job) == 2
    assert _value("finetune_operator_forgiven_restarts_total", **job) == 1
    metrics.forget_job_series("ns", "lost")
    assert _value("finetune_operator_forgiven_restarts_total", **job) is None


def test_a_failure_counted_in_the_pass_that_takes_one_back_shows_on_both_counters() -> None:
    """status.restarts unchanged (+1 genuine, -1 a lost node's): the net change alone hid both."""
    job = {"namespace": "ns", "finetunejob": "both"}
    metrics.record_restarts("ns", "both", 0, taken_back=1)
    assert _value("finetune_operator_restarts_total", **job) == 1
    assert _value("finetune_operator_forgiven_restarts_total", **job) == 1
    metrics.record_restarts("ns", "both", -1, taken_back=1)  # only taken back
    assert _value("finetune_operator_restarts_total", **job) == 1
    assert _value("finetune_operator_forgiven_restarts_total", **job) == 2
    metrics.forget_job_series("ns", "both")


def test_jobs_by_state_follows_each_job() -> None:
    base = {p: _value("finetune_operator_jobs", state=p) or 0.0 for p in ("Pending", "Running")}
    metrics.set_job_phase("ns/a", "Pending")
    metrics.set_job_phase("ns/b", "Pending")
    metrics.set_job_phase("ns/a", "Running")
    metrics.set_job_phase("ns/a", "Running")  # same phase twice: counted once
    assert _value("finetune_operator_jobs", state="Pending") == base["Pending"] + 1
    assert _value("finetune_operator_jobs", state="Running") == base["Running"] + 1
    metrics.set_job_phase("ns/a", None)
    metrics.set_job_phase("ns/b", None)
    assert _value("finetune_operator_jobs", state="Pending") == base["Pending"]
    assert _value("finetune_operator_jobs", state="Running") == base["Running"]


def test_finished_job_series_are_deleted() -> None:
    done = {"namespace": "a", "finetunejob": "done"}
    metrics.record_restarts("a", "done", 2)
    metrics.record_preemptions("a", "done", 1)
    metrics.record_evictions("a", "done", 1)
    metrics.record_hangs("a", "done", 1)
    metrics.set_straggler_ratios("a", "done", {3: 1.4})
    assert _value("finetune_operator_restarts_total", **done) == 2
    assert _value("finetune_operator_straggler_ratio", **done, rank="3") == 1.4
    metrics.forget_job_series("a", "done")
    metrics.forget_job_series("a", "done")  # twice is harmless
    for name in ("restarts", "preemptions", "evictions", "hangs"):
        assert _value(f"finetune_operator_{name}_total", **done) is None
    assert _value("finetune_operator_straggler_ratio", **done, rank="3") is None


def test_jobs_named_alike_in_two_namespaces_keep_apart() -> None:
    metrics.set_straggler_ratios("a", "same", {0: 1.0, 1: 1.5})
    metrics.set_straggler_ratios("b", "same", {0: 1.1})
    metrics.record_evictions("a", "same", 1)
    assert (
        _value("finetune_operator_straggler_ratio", namespace="a", finetunejob="same", rank="1")
        == 1.5
    )
    assert (
        _value("finetune_operator_straggler_ratio", namespace="b", finetunejob="same", rank="0")
        == 1.1
    )
    # A rank no longer reported loses its series; the other job's series stay.
    metrics.set_straggler_ratios("a", "same", {0: 1.0})
    assert (
        _value("finetune_operator_straggler_ratio", namespace="a", finetunejob="same", rank="1")
        is None
    )
    metrics.forget_job_series("a", "same")
    assert _value("finetune_operator_evictions_total", namespace="a", finetunejob="same") is None
    assert (
        _value("finetune_operator_straggler_ratio", namespace="b", finetunejob="same", rank="0")
        == 1.1
    )
    metrics.forget_job_series("b", "same")


def test_reconcile_timing_counts_errors() -> None:
    errors = _value("finetune_operator_reconcile_errors_total") or 0.0
    count = _value("finetune_operator_reconcile_duration_seconds_count") or 0.0
    with metrics.timed_reconcile():
        pass
    with pytest.raises(RuntimeError), metrics.timed_reconcile():
        raise RuntimeError("boom")
    assert _value("finetune_operator_reconcile_errors_total") == errors + 1
    assert _value("finetune_operator_reconcile_duration_seconds_count") == count + 2


def test_status_patch_only_changed_fields() -> None:
    old = {"phase": "Running", "restarts": 1, "step": 5, "kopf": {"progress": {}}}
    assert read_status(old) == FineTuneJobStatus(phase="Running", restarts=1, step=5)
    assert status_patch(old, FineTuneJobStatus(phase="Running", restarts=1, step=5)) == {}
    assert status_patch(old, FineTuneJobStatus(phase="Running", restarts=2)) == {
        "restarts": 2,
        "step": None,  # merge-patch removal
    }
    assert read_status({"restarts": "not a number"}) == FineTuneJobStatus()
