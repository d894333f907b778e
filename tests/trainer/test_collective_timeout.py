"""The training group's collective timeout through a run (finetune_trainer.collective_timeout)
and how a timed-out collective is reported (finetune_trainer.distributed)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from finetune_operator.api.elastic_timeouts import CollectiveTimeouts
from finetune_trainer.collective_timeout import TrainingTimeout, step_timeout
from finetune_trainer.crash import KIND_PEER_LOST, RankFailure, crash_report
from finetune_trainer.distributed import (
    CollectiveTimeoutError,
    describe_failure,
    set_training_timeout,
)
from tests.trainer.conftest import free_port, make_job

T = CollectiveTimeouts(startup=600, steady=60, checkpoint=900, steady_fixed=False)
GLOO_TIMEOUT = RuntimeError(
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms "
    "for recv operation to complete"
)


@pytest.mark.parametrize(
    ("steps_run", "after_save", "expected"),
    [(0, False, 600), (1, False, 600), (2, False, 45), (2, True, 600), (9, False, 45)],
    ids=["first-step", "second-step", "warm", "after-save", "later"],
)
def test_step_timeout(steps_run: int, after_save: bool, expected: float) -> None:
    assert step_timeout(T, steps_run=steps_run, after_save=after_save, steady=45) == expected


def test_training_timeout_phases_through_a_run() -> None:
    job = make_job()  # planned step 0.1 s: steady is the 60 s floor unless a step is slower
    applied: list[float] = []
    t = TrainingTimeout(job, T, applied.append)

    def step(seconds: float, saved: bool = False) -> None:
        t.before_step()
        t.step_done(seconds)
        t.relax()  # before maybe_save, as the loop does
        t.saved(saved)

    step(90.0)  # compile
    step(20.0)  # the first warm step, measured: 5 x 20 s
    assert applied == []  # still the startup timeout the group was created with
    step(20.0)
    assert applied == [100.0, 600]  # short for the step, back to startup around the save
    step(20.0, saved=True)
    step(20.0)  # the step after a save keeps the startup timeout
    assert applied == [100.0, 600, 100.0, 600]
    step(20.0)
    assert applied[-2:] == [100.0, 600]


def test_user_timeout_is_not_widened_by_the_measured_step() -> None:
    applied: list[float] = []
    fixed = CollectiveTimeouts(startup=600, steady=15, checkpoint=600, steady_fixed=True)
    t = TrainingTimeout(make_job(), fixed, applied.append)
    for _ in range(3):
        t.before_step()
        t.step_done(30.0)
    assert applied == [15]


def test_set_training_timeout_changes_the_group() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=600))  # fmt: skip
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        set_training_timeout(42)
        assert backend.options._timeout == datetime.timedelta(seconds=42)
    finally:
        dist.destroy_process_group()


def test_a_collective_timeout_reads_as_a_lost_peer() -> None:
    described = describe_failure(GLOO_TIMEOUT, 60.0)
    assert isinstance(described, CollectiveTimeoutError)
    assert described.__cause__ is GLOO_TIMEOUT
    assert str(described).startswith("a collective timed out after 60s: a peer stopped answering")
    other = ValueError("bad row")
    assert describe_failure(other, 60.0) is other
    failure = RankFailure(rank=1, exitcode=1, message=f"CollectiveTimeoutError: {described}",
                          timestamp=5, has_error_file=True)  # fmt: skip
    crash = crash_report([failure])["crash"]
    assert crash["kind"] == KIND_PEER_LOST and "Timed out waiting" in crash["message"]


def test_nccl_abort_is_explained() -> None:
    crash = crash_report([RankFailure(rank=0, exitcode=-6, timestamp=5)])["crash"]
    assert crash["signal"] == "SIGABRT" and "NCCL's watchdog" in crash["message"]
