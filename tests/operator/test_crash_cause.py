"""Why a worker crashed, as the job's conditions and Events say it: the trainer's crash report,
a log's tail (FallbackToLogsOnError), the kubelet's OOMKilled; bounded."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from finetune_operator.api.constants import (
    COND_FAILED,
    COND_SUCCEEDED,
    LABEL_JOB,
    LABEL_ROLE,
    LABEL_WORKER_INDEX,
)
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.reconcile import JobRef, observe_pod, reconcile_job
from finetune_operator.reconcile.conditions import find
from finetune_operator.reconcile.crash import MAX_CAUSE_CHARS, crash_cause
from tests.operator.factories import UID, make_plan, quickstart_raw

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def report(**crash: Any) -> str:
    return json.dumps({"crash": crash})


IMPORT_TAIL = """Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
ModuleNotFoundError: No module named 'flash_attn'
E1123 12:00:01 failed (exitcode: 1) local_rank: 0 (pid: 42) of binary: /usr/bin/python3
ChildFailedError:
============================================================
finetune_trainer FAILED
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


STEP_LINES = '{"step": 60, "loss": 2.1}\n{"step": 61, "loss": 2.0}\n'


@pytest.mark.parametrize(
    ("message", "reason", "limit", "expected"),
    [
        (report(rank=3, kind="Exception", message="RuntimeError: expected Float", location="trainer.py:212"),
         "Error", None, "rank 3: RuntimeError: expected Float (trainer.py:212)"),
        (report(rank=0, kind="OutOfMemory", message="OutOfMemoryError: CUDA out of memory",
                planned="planned 61.2 GiB per GPU of 79.1 GiB", location="trainer.py:290"),
         "Error", None, "rank 0: OutOfMemoryError: CUDA out of memory [planned 61.2 GiB per GPU of 79.1 GiB] (trainer.py:290)"),
        (report(rank=1, kind="Signal", signal="SIGSEGV", message="died of SIGSEGV"),
         "Error", None, "rank 1: died of SIGSEGV"),
        (report(rank=1, kind="Signal", signal="SIGKILL", message="died of SIGKILL"),
         "OOMKilled", "64Gi", "OOMKilled: the pod exceeded resources.memory (64Gi); rank 1: died of SIGKILL"),
        ("", "OOMKilled", None, "OOMKilled: the pod exceeded resources.memory"),
        (IMPORT_TAIL, "Error", None, "ModuleNotFoundError: No module named 'flash_attn'"),
        ("torchrun: error: unrecognized arguments: --bogus\n", "Error", None,
         "torchrun: error: unrecognized arguments: --bogus"),
        (json.dumps({"step": 14, "checkpointStep": 12}), "Error", None, None),
        (json.dumps({"rank": 0, "error": "strategy x is not supported"}), "Error", None, None),
        (None, "Error", None, None),
        (STEP_LINES, "Error", None, None),
    ],
    ids=["exception", "accelerator-oom", "signal", "oom-killed-and-report", "oom-killed",
         "log-tail-import-error", "log-tail-last-line", "final-report", "config-error", "nothing",
         "log-tail-of-step-lines"],
)  # fmt: skip
def test_crash_cause(
    message: str | None, reason: str, limit: str | None, expected: str | None
) -> None:
    assert crash_cause(message, reason, limit, exit_code=1) == expected


@pytest.mark.parametrize(
    ("message", "code", "expected"),
    [(STEP_LINES + "training step 62\n", 137, "killed by SIGKILL"),
     ("", 139, "killed by SIGSEGV"),
     (IMPORT_TAIL, 137, "ModuleNotFoundError: No module named 'flash_attn'"),
     ("", 1, None)],
    ids=["sigkill-log-tail-is-not-why", "sigsegv", "exception-line-still-wins", "plain-exit"],
)  # fmt: skip
def test_a_killed_container_says_the_signal(message: str, code: int, expected: str | None) -> None:
    assert crash_cause(message, "Error", None, exit_code=code) == expected


def test_a_huge_cause_is_one_bounded_line_that_keeps_the_location() -> None:
    message = report(
        rank=2, kind="Exception", message="ValueError: " + "row\n" * 2000, location="data.py:7"
    )
    cause = crash_cause(message)
    assert cause is not None and len(cause) <= MAX_CAUSE_CHARS and "\n" not in cause
    assert cause.startswith("rank 2: ValueError: row row") and cause.endswith("… (data.py:7)")


# torch's own CUDA OOM message, as long as it is: the plan's figure must survive the cut.
CUDA_OOM = (
    "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
    "of 79.19 GiB of which 1.21 GiB is free. Including non-PyTorch memory, this process has 77.97 "
    "GiB memory in use. Of the allocated memory 75.02 GiB is allocated by PyTorch, and 1.48 GiB is "
    "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
    "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


def test_a_long_cuda_oom_keeps_the_planned_figure_and_location() -> None:
    message = report(rank=4, kind="OutOfMemory", message=CUDA_OOM, location="trainer.py:290",
                     planned="planned 61.2 GiB per GPU of 79.1 GiB")  # fmt: skip
    cause = crash_cause(message)
    assert cause is not None and len(cause) <= MAX_CAUSE_CHARS
    assert cause.startswith(
        "rank 4: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    )
    assert cause.endswith("… [planned 61.2 GiB per GPU of 79.1 GiB] (trainer.py:290)")


def _worker(index: int, phase: str, *, exit_code: int | None = None, message: str | None = None,
            reason: str = "Error", memory: str | None = None, finished: datetime = T0) -> Any:  # fmt: skip
    status: dict[str, Any] = {"phase": phase, "podIP": "10.0.0.1",
                              "conditions": [{"type": "Ready", "status": str(phase == "Running")}]}  # fmt: skip
    if exit_code is not None:
        term = {
            "exitCode": exit_code,
            "reason": reason,
            "finishedAt": finished.strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        if message:
            term["message"] = message
        status["containerStatuses"] = [{"name": "trainer", "state": {"terminated": term}}]
    container: dict[str, Any] = {"name": "trainer"}
    if memory:
        container["resources"] = {"limits": {"memory": memory}}
    labels = {LABEL_JOB: "qs", LABEL_ROLE: "worker", LABEL_WORKER_INDEX: str(index)}
    meta = {"name": f"qs-worker-{index}", "uid": f"uid-{index}-{phase}", "labels": labels}
    return observe_pod(
        {
            "metadata": meta,
            "spec": {"nodeName": "node-a", "containers": [container]},
            "status": status,
        }
    )


def _rdzv() -> Any:
    labels = {LABEL_JOB: "qs", LABEL_ROLE: "rendezvous"}
    meta = {
        "name": "qs-rdzv",
        "uid": "uid-rdzv",
        "labels": labels,
        "creationTimestamp": "2025-01-01T00:00:00Z",
    }
    return observe_pod({"metadata": meta, "spec": {}, "status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}})  # fmt: skip


def test_restarting_and_failed_conditions_and_events_name_the_root_cause() -> None:
    job = JobRef(name="qs", namespace="ns", uid=UID, generation=1)
    crash = report(
        rank=3, kind="Exception", message="RuntimeError: bad batch", location="trainer.py:212"
    )
    failed = _worker(1, "Failed", exit_code=1, message=crash)
    pods = [_rdzv(), _worker(0, "Running"), failed]
    plan = make_plan(2)

    def step(status: FineTuneJobStatus, now: datetime, spec: dict[str, Any]) -> Any:
        return reconcile_job(
            job, spec, status, pods, now, planner=lambda _: plan, ensured_generation=1
        )

    cause = "rank 3: RuntimeError: bad batch (trainer.py:212)"
    out = step(FineTuneJobStatus(), T0 + timedelta(minutes=5), quickstart_raw())
    restarting = find(out.status.conditions, COND_SUCCEEDED)
    assert restarting is not None and restarting.reason == "Restarting"
    assert (
        restarting.message
        == f"pod qs-worker-1 failed on node node-a (exit code 1, Error): {cause}; replacing it"
    )
    warnings = [e for e in out.events if e.type == "Warning" and e.reason == "Restarting"]
    assert any(cause in e.message and "(1 of 3 restarts used)" in e.message for e in warnings), (
        out.events
    )

    spec = quickstart_raw()
    spec["faultTolerance"]["maxRestarts"] = 0
    out = step(FineTuneJobStatus(), T0, spec)
    failed_cond = find(out.status.conditions, COND_FAILED)
    assert failed_cond is not None and failed_cond.reason == "BackoffLimitExceeded"
    assert cause in failed_cond.message and len(failed_cond.message) < 1024
    assert any(e.reason == "BackoffLimitExceeded" and cause in e.message for e in out.events)


def test_failed_names_the_pod_that_raised_not_the_one_that_lost_its_peer() -> None:
    job = JobRef(name="qs", namespace="ns", uid=UID, generation=1)
    lost = report(rank=0, kind="PeerLost", message="RuntimeError: [gloo] Connection closed by peer")
    raised = report(rank=1, kind="Exception", message="ValueError: bad row", location="data.py:9")
    spec = quickstart_raw()
    spec["faultTolerance"]["maxRestarts"] = 0
    for early, late in ((0, 1), (1, 0)):  # either may finish first
        times = {early: T0, late: T0 + timedelta(seconds=1)}
        pods = [_rdzv(), _worker(0, "Failed", exit_code=1, message=lost, finished=times[0]),
                _worker(1, "Failed", exit_code=1, message=raised, finished=times[1])]  # fmt: skip
        out = reconcile_job(job, spec, FineTuneJobStatus(), pods, T0 + timedelta(seconds=5),
                            planner=lambda _: make_plan(2), ensured_generation=1)  # fmt: skip
        failed = find(out.status.conditions, COND_FAILED)
        assert failed is not None and failed.status == "True"
        assert (
            failed.message.startswith("pod qs-worker-1 failed")
            and "ValueError: bad row" in failed.message
        )


@pytest.mark.parametrize(
    "lost_first", [True, False], ids=["peer-lost-finished-first", "cause-finished-first"]
)
def test_restarting_names_the_root_cause_through_the_whole_backoff(lost_first: bool) -> None:
    """Pass after pass while the failed pods wait out their backoff and are replaced one by
    one, the Restarting condition names the pod that raised, never the one that only lost
    its peer (worker pods never restart in place: restartPolicy Never, so `state.terminated`
    is their only record, and a replaced pod's is gone)."""
    job = JobRef(name="qs", namespace="ns", uid=UID, generation=1)
    lost = report(rank=0, kind="PeerLost", message="RuntimeError: [gloo] Connection closed by peer")
    raised = report(rank=1, kind="Exception", message="ValueError: bad row", location="data.py:9")
    finished = (
        {0: T0, 1: T0 + timedelta(seconds=1)}
        if lost_first
        else {0: T0 + timedelta(seconds=1), 1: T0}
    )
    failed = {0: _worker(0, "Failed", exit_code=1, message=lost, finished=finished[0]),
              1: _worker(1, "Failed", exit_code=1, message=raised, finished=finished[1])}  # fmt: skip
    status, replaced = FineTuneJobStatus(), []
    for second in range(12):
        pods = [_rdzv(), *failed.values()]
        out = reconcile_job(job, quickstart_raw(), status, pods, T0 + timedelta(seconds=second),
                            planner=lambda _: make_plan(2), ensured_generation=1)  # fmt: skip
        status = out.status
        condition = find(status.conditions, COND_SUCCEEDED)
        assert condition is not None and condition.reason == "Restarting"
        if failed:
            assert condition.message.startswith("pod qs-worker-1 failed"), (
                second,
                condition.message,
            )
            assert "ValueError: bad row" in condition.message
        for deletion in out.actions.delete:  # the apply layer deletes it: gone next pass
            replaced.append(deletion.name)
            failed = {i: p for i, p in failed.items() if p.name != deletion.name}
    # Both replaced, the one that only lost its peer first; one failure, counted once (the
    # pod that lost its peer has no failure of its own: reconcile/budget.py). Their agents
    # gave up, which shuts the rendezvous down: the store is replaced with them.
    workers = [name for name in replaced if name != "qs-rdzv"]
    assert workers == ["qs-worker-0", "qs-worker-1"] and status.restarts == 1
    assert "qs-rdzv" in replaced


def test_oom_killed_names_the_memory_limit() -> None:
    view = _worker(0, "Failed", exit_code=137, reason="OOMKilled", memory="64Gi")
    assert view.describe_failure() == (
        "pod qs-worker-0 failed on node node-a (exit code 137): "
        "OOMKilled: the pod exceeded resources.memory (64Gi)"
    )


def test_every_container_falls_back_to_its_log_on_error(owner: Any, quickstart_spec: Any) -> None:
    """A crash before the trainer's handler (an import error, torchrun's own failure, a store
    that dies) still reaches the operator: the kubelet puts the log's tail in the message."""
    from finetune_operator.resources import build_rendezvous_pod, build_worker_pod

    pods = [build_worker_pod(owner, quickstart_spec, make_plan(2), 0),
            build_rendezvous_pod(owner, quickstart_spec)]  # fmt: skip
    for pod in pods:
        for container in pod["spec"]["containers"]:
            assert container["terminationMessagePolicy"] == "FallbackToLogsOnError", container[
                "name"
            ]
