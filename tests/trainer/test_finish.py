"""How a run ends (finetune_trainer/finish.py): the exit code torchrun and the operator read,
and whether the process must exit without waiting for its final checkpoint."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from finetune_trainer import finish
from finetune_trainer.checkpointer import NoOpCheckpointer
from finetune_trainer.finish import RunEnd, finish_run
from finetune_trainer.stop_signal import StopSignal


class SlowFinalSave(NoOpCheckpointer):
    """A final save still writing when the grace period is over."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def finish(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        return False


@pytest.fixture
def stop_signal() -> Iterator[StopSignal]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield StopSignal()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_completed_run_exits_zero(stop_signal: StopSignal) -> None:
    end = finish_run(NoOpCheckpointer(), stop_signal, step=10, stopped=False, grace_seconds=30)
    assert end == RunEnd(0)


def test_a_failed_final_save_is_no_clean_finish(stop_signal: StopSignal) -> None:
    checkpointer = NoOpCheckpointer()
    checkpointer.last_committed_step, checkpointer.last_failed_step = 8, 10
    assert finish.unrecovered_failure(checkpointer) == 10
    end = finish_run(checkpointer, stop_signal, step=10, stopped=False, grace_seconds=30)
    assert end == RunEnd(finish.EXIT_FINAL_CHECKPOINT_FAILED)
    checkpointer.last_committed_step = 10  # a later save committed: recovered
    assert finish.unrecovered_failure(checkpointer) == 0


def test_a_signalled_rank_exits_as_stopped_within_its_grace(stop_signal: StopSignal) -> None:
    signal.raise_signal(signal.SIGTERM)
    assert stop_signal.requested
    slow = SlowFinalSave()
    end = finish_run(slow, stop_signal, step=4, stopped=True, grace_seconds=30)
    assert end == RunEnd(finish.EXIT_STOPPED, hard_exit=True)
    assert slow.timeouts and slow.timeouts[0] is not None and 0 < slow.timeouts[0] <= 30
    ok = finish_run(NoOpCheckpointer(), stop_signal, step=4, stopped=True, grace_seconds=30)
    assert ok == RunEnd(finish.EXIT_STOPPED)


def test_a_rank_stopped_for_a_peer_exits_for_a_restart(
    stop_signal: StopSignal, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(finish, "PEER_SIGNAL_WAIT_SECONDS", 0.2)
    end = finish_run(NoOpCheckpointer(), stop_signal, step=4, stopped=True, grace_seconds=30)
    assert end == RunEnd(finish.EXIT_PEER_STOPPED)


def test_a_failing_close_still_tears_the_group_down_and_fails_the_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The entry point after a completed run: a close that raises (the step trace's file on
    a full disk) must not escape `main`, which would skip `destroy_distributed` and the
    `exit_process` that follows (the interpreter's finalisation then aborts on the group's
    threads): the rank fails with its error recorded, the group torn down."""
    import finetune_trainer.__main__ as entry
    import finetune_trainer.trainer as trainer_module

    class ClosingFails:
        hard_exit = False

        def __init__(self, job: object, env: object) -> None:
            pass

        def train(self) -> int:
            return 0

        def close(self) -> None:
            raise OSError(28, "No space left on device")

    torn_down: list[bool] = []
    recorded: list[BaseException] = []
    monkeypatch.setattr(trainer_module, "Trainer", ClosingFails)
    monkeypatch.setattr(entry, "load_job_config", lambda path: None)
    monkeypatch.setattr(entry, "destroy_distributed", lambda: torn_down.append(True))
    monkeypatch.setattr(entry, "record_exception", recorded.append)
    assert entry.main(["--config", "job.json"]) == 1
    assert torn_down == [True]
    assert [type(e) for e in recorded] == [OSError]
