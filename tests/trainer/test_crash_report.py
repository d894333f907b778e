"""The crash report: torchelastic's failures (real error files, real ProcessFailure and
ChildFailedError) → the root cause, classified and within the termination log's 4096 bytes."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from finetune_operator.api.constants import CONFIG_PATH
from finetune_trainer.crash import (
    KIND_EXCEPTION,
    KIND_EXIT,
    KIND_OUT_OF_MEMORY,
    KIND_PEER_LOST,
    KIND_SIGNAL,
    MAX_REPORT_BYTES,
    OWN_ROUNDS_ENV,
    ROUND_FILE,
    RankFailure,
    crash_report,
    failure_from_process,
    fit_report,
    locate,
    parse_rounds,
    record_peer_stop,
    root_cause,
)
from finetune_trainer.launch import (
    attempt_round,
    config_path,
    max_restarts,
    own_failure_rounds,
    reused_attempts,
    with_log_dir,
)
from finetune_trainer.termination_log import (
    write_crash_report,
    write_error_report,
    write_final_report,
)

TRACEBACK = """Traceback (most recent call last):
  File "/app/finetune_trainer/__main__.py", line 58, in main
    code = trainer.train()
  File "/app/finetune_trainer/trainer.py", line 212, in _step
    loss = self.model(**batch).loss
  File "/venv/torch/nn/modules/module.py", line 1775, in _call_impl
    return forward_call(*args, **kwargs)
RuntimeError: expected scalar type Float
but found Half
"""


def _error_file(tmp_path: Path, error: BaseException, name: str = "error.json") -> str:
    """What the trainer's `record` writes: the real ErrorHandler, inside the except block."""
    path = tmp_path / name
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(path)
    try:
        try:
            raise error
        except BaseException as e:
            ErrorHandler().record_exception(e)
    finally:
        del os.environ["TORCHELASTIC_ERROR_FILE"]
    return str(path)


def _failures(error: ChildFailedError) -> list[RankFailure]:
    return [failure_from_process(rank, f) for rank, f in error.failures.items()]


def test_exception_names_type_message_and_our_frame(tmp_path: Path) -> None:
    file = _error_file(tmp_path, ValueError("bad data row 17"))
    error = ChildFailedError("trainer", {3: ProcessFailure(1, 4242, 1, file)})
    report = crash_report(_failures(error))
    crash = report["crash"]
    assert crash["rank"] == 3
    assert crash["kind"] == KIND_EXCEPTION and crash["exception"] == "ValueError"
    assert crash["message"] == "ValueError: bad data row 17"
    assert crash["location"].startswith("test_crash_report.py:")  # where it was raised
    assert "raise error" in crash["traceback"] and "ValueError" not in crash["traceback"]
    assert crash["failedRanks"] == [3]


def test_accelerator_oom_says_what_was_planned(tmp_path: Path) -> None:
    file = _error_file(
        tmp_path, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    )
    error = ChildFailedError("trainer", {0: ProcessFailure(0, 1, 1, file)})
    crash = crash_report(_failures(error), planned="planned 61.2 GiB per GPU of 79.1 GiB")["crash"]
    assert crash["kind"] == KIND_OUT_OF_MEMORY
    assert crash["exception"] == "torch.OutOfMemoryError"  # qualified, from the traceback
    assert crash["planned"] == "planned 61.2 GiB per GPU of 79.1 GiB"


def test_signal_death_beats_the_peers_it_took_down(tmp_path: Path) -> None:
    """A SIGKILLed rank leaves no error file, and torchrun stamps it when it notices: later
    than the peer's 'Connection closed by peer'. The killed rank is still the root cause."""
    peer = _error_file(tmp_path, RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1"))
    killed = ProcessFailure(1, 7, -9, "<N/A>")
    error = ChildFailedError("trainer", {0: ProcessFailure(0, 6, 1, peer), 1: killed})
    report = crash_report(_failures(error))
    assert report["crash"]["rank"] == 1
    assert report["crash"]["kind"] == KIND_SIGNAL and report["crash"]["signal"] == "SIGKILL"
    assert report["crash"]["message"].startswith("died of SIGKILL")
    assert report["crash"]["failedRanks"] == [0, 1]


@pytest.mark.parametrize(
    ("failures", "root"),
    [
        ([RankFailure(rank=0, exitcode=1, message="RuntimeError: a", timestamp=10),
          RankFailure(rank=1, exitcode=1, message="RuntimeError: b", timestamp=9)], 1),
        ([RankFailure(rank=0, exitcode=1, message="DistNetworkError: Connection reset by peer", timestamp=10),
          RankFailure(rank=1, exitcode=1, message="ValueError: x", timestamp=10)], 1),
        ([RankFailure(rank=2, exitcode=1, message="RuntimeError: a", timestamp=10),
          RankFailure(rank=1, exitcode=1, message="RuntimeError: b", timestamp=10)], 1),
        ([RankFailure(rank=0, exitcode=1, message="RuntimeError: Connection closed by peer", timestamp=12),
          RankFailure(rank=1, exitcode=1, message="RuntimeError: Connection closed by peer", timestamp=11)], 1),
    ],
    ids=["earliest", "peer-loss-is-a-consequence", "tie-lowest-rank", "all-peer-loss-earliest"],
)  # fmt: skip
def test_root_cause(failures: list[RankFailure], root: int) -> None:
    assert root_cause(failures).rank == root


def test_a_group_that_only_lost_a_peer_says_so(tmp_path: Path) -> None:
    file = _error_file(
        tmp_path, RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    )
    error = ChildFailedError("trainer", {0: ProcessFailure(0, 3, 1, file)})
    assert crash_report(_failures(error))["crash"]["kind"] == KIND_PEER_LOST


def test_exit_without_error_file_points_at_the_log() -> None:
    error = ChildFailedError("trainer", {0: ProcessFailure(0, 9, 1, "<N/A>")})
    crash = crash_report(_failures(error))["crash"]
    assert crash["kind"] == KIND_EXIT and "exited with code 1" in crash["message"]


def test_location_prefers_the_trainers_own_frame() -> None:
    assert locate(TRACEBACK) == "trainer.py:212"
    assert locate('  File "/venv/torch/x.py", line 3, in f\n') == "x.py:3"
    assert locate("no frames here") is None


def test_a_huge_message_is_cut_and_the_json_stays_valid() -> None:
    failure = RankFailure(rank=5, exitcode=1, message="RuntimeError: " + "é\"x" * 5000,
                          traceback=TRACEBACK * 40, timestamp=1, has_error_file=True)  # fmt: skip
    report = crash_report([failure])
    text = json.dumps(report)
    assert len(text.encode()) <= MAX_REPORT_BYTES
    crash = json.loads(text)["crash"]
    assert crash["exception"] == "RuntimeError" and crash["location"] == "trainer.py:212"
    assert crash["message"].startswith("RuntimeError: é") and crash["message"].endswith("…")


def test_fit_keeps_the_traceback_tail_first() -> None:
    report = {"crash": {"rank": 0, "kind": KIND_EXCEPTION, "message": "E: m",
                                   "traceback": "\n".join(f"line {i}" for i in range(900))}}  # fmt: skip
    fitted = fit_report(report, limit=1000)
    assert len(json.dumps(fitted).encode()) <= 1000
    assert (
        fitted["crash"]["traceback"].endswith("line 899") and fitted["crash"]["message"] == "E: m"
    )


def test_crash_report_joins_a_final_report_and_yields_to_a_configuration_error(
    tmp_path: Path,
) -> None:
    log = tmp_path / "termination-log"
    log.touch()
    huge = RankFailure(rank=1, exitcode=1, message="RuntimeError: " + "x" * 9000,
                       traceback=TRACEBACK, timestamp=1, has_error_file=True)  # fmt: skip
    report = crash_report([huge])
    assert write_crash_report(report, str(log))
    assert json.loads(log.read_text()) == report
    # A trainer's own final report (say, its final save failed) stays beside the crash.
    write_final_report(step=14, loss=1.0, checkpoint_step=12, rank=0, path=str(log),
                       checkpoint_failed_step=14, output="s3://b/" + "o" * 300)  # fmt: skip
    assert write_crash_report(report, str(log))
    text = log.read_text()
    merged = json.loads(text)
    assert len(text.encode()) <= MAX_REPORT_BYTES
    assert merged["checkpointStep"] == 12 and merged["crash"]["rank"] == 1
    # A final report too big to leave room: the crash alone, whole JSON the kubelet keeps.
    log.write_text(json.dumps({"step": 3, "output": "o" * 4050}))
    assert write_crash_report(report, str(log))
    assert json.loads(log.read_text()).keys() == {"crash"}
    write_error_report("strategy deepspeed needs ...", rank=0, path=str(log))
    assert not write_crash_report(report, str(log))  # the refusal is what the operator needs
    assert json.loads(log.read_text())["error"].startswith("strategy deepspeed")
    assert not write_crash_report(report, str(tmp_path / "absent"))  # outside a pod


def test_the_pod_log_ends_with_our_root_cause_after_torchruns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """torchrun's summary names its first failure (rank 0 here, which only lost its peer: the
    killed rank is stamped later); the launcher's last lines name ours, as the termination log
    does, and say why the two differ."""
    from finetune_trainer import launch

    peer = _error_file(tmp_path, RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1"))
    error = ChildFailedError(
        "trainer", {0: ProcessFailure(0, 6, 1, peer), 1: ProcessFailure(1, 7, -9, "<N/A>")}
    )

    def torchrun(_: list[str]) -> None:
        raise error

    log = tmp_path / "termination-log"
    log.touch()
    monkeypatch.setattr(launch, "torchrun_main", torchrun)
    monkeypatch.setenv("FT_TERMINATION_LOG", str(log))
    assert launch.main(["--config", str(tmp_path / "absent.json")]) == launch.EXIT_FAILED
    err = capsys.readouterr().err
    assert json.loads(log.read_text())["crash"]["rank"] == 1
    summary, ours = (
        err.index("Root Cause (first observed failure)"),
        err.index("crash report: rank 1: died of SIGKILL"),
    )
    assert summary < ours  # ours comes last: what a reader of the log's end sees
    assert err.rstrip().endswith("whole-second timestamp)")
    assert "the root cause is rank 1, not rank 0" in err and "it only lost its peer" in err

    # When torchrun's pick is ours, one line, no correction.
    raised = _error_file(tmp_path, ValueError("bad row"), name="raised.json")
    error = ChildFailedError("trainer", {0: ProcessFailure(0, 6, 1, raised)})
    assert launch.main([]) == launch.EXIT_FAILED
    err = capsys.readouterr().err
    assert re.fullmatch(r"crash report: rank 0: ValueError: bad row \(test_crash_report.py:\d+\)",
                        err.rstrip().splitlines()[-1])  # fmt: skip
    assert "not rank" not in err


def test_a_pod_that_only_lost_a_peer_says_its_log_is_not_the_jobs_root_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its torchrun summary and report name a peer loss, while the job's condition names the
    other pod's failure (reconcile/crash.py): the log's last line says so."""
    from finetune_trainer import launch

    peer = _error_file(tmp_path, RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:1"))

    def torchrun(_: list[str]) -> None:
        raise ChildFailedError("trainer", {0: ProcessFailure(0, 6, 1, peer)})

    log = tmp_path / "termination-log"
    log.touch()
    monkeypatch.setattr(launch, "torchrun_main", torchrun)
    monkeypatch.setenv("FT_TERMINATION_LOG", str(log))
    assert launch.main(["--max-restarts=2", "-m", "finetune_trainer"]) == launch.EXIT_FAILED
    crash = json.loads(log.read_text())["crash"]
    # No attempt on disk to tell its own failures from its peers': none claimed (the operator
    # counts the restarts a PeerLost pod reports, and a peer's departure must not spend).
    assert (crash["kind"], crash["restarts"]) == (KIND_PEER_LOST, 0)
    last = capsys.readouterr().err.rstrip().splitlines()[-1]
    assert last.startswith("crash report: this pod's ranks only lost a peer in another pod")
    assert "Restarting (or Failed) condition names" in last


def test_config_path_is_the_programs() -> None:
    argv = ["--nnodes=1", "-m", "finetune_trainer", "--config", "/x/job.json"]
    assert config_path(argv) == "/x/job.json"
    assert config_path(["-m", "finetune_trainer", "--config=/y.json"]) == "/y.json"
    assert config_path(["-m", "finetune_trainer"]) == CONFIG_PATH


def test_max_restarts_is_torchruns_not_the_programs() -> None:
    assert max_restarts(["--nnodes=1", "--max-restarts=2", "-m", "finetune_trainer"]) == 2
    assert max_restarts(["--max_restarts", "3", "-m", "finetune_trainer"]) == 3
    assert max_restarts(["--nnodes=1", "-m", "x", "--max-restarts=9"]) == 0  # the program's
    assert max_restarts(["--max-restarts=nope"]) == 0


def test_the_crash_report_says_how_often_torchrun_restarted_the_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun gives up (ChildFailedError) only once its --max-restarts are spent: without the
    attempts' error files the report carries them all, for the operator's one restart budget
    (reconcile/budget.py); with them, those after a failure of the pod's own."""
    from finetune_trainer import launch

    raised = _error_file(tmp_path, ValueError("bad row"))

    def torchrun(_: list[str]) -> None:
        raise ChildFailedError("trainer", {0: ProcessFailure(0, 6, 1, raised)})

    log = tmp_path / "termination-log"
    log.touch()
    monkeypatch.setattr(launch, "torchrun_main", torchrun)
    monkeypatch.setenv("FT_TERMINATION_LOG", str(log))
    argv = ["--nnodes=1:2", "--max-restarts=2", "-m", "finetune_trainer", "--config", "/none"]
    assert launch.main(argv) == launch.EXIT_FAILED
    crash = json.loads(log.read_text())["crash"]
    assert (crash["kind"], crash["restarts"]) == (KIND_EXCEPTION, 2)

    # Through main: torchrun writes its attempts under the launcher's --log-dir (a peer left
    # in attempt 0, the trainer raised in attempts 1 and 2), which is removed afterwards.
    seen: list[Path] = []

    def attempts(args: list[str]) -> None:
        log_dir = Path(next(a for a in args if a.startswith("--log-dir=")).split("=", 1)[1])
        seen.append(log_dir)
        _attempt(log_dir, 0, {0: RuntimeError("[gloo] Connection reset by peer")})
        _attempt(log_dir, 1, {0: ValueError("bad row")})
        _attempt(log_dir, 2, {0: ValueError("bad row")})
        torchrun(args)

    monkeypatch.setattr(launch, "torchrun_main", attempts)
    assert launch.main(argv) == launch.EXIT_FAILED
    assert json.loads(log.read_text())["crash"]["restarts"] == 1
    assert seen and not seen[0].exists()


def _attempt(log_dir: Path, k: int, errors: dict[int, BaseException | None]) -> None:
    """torchelastic's layout (DefaultLogsSpecs): <log dir>/<run>_<x>/attempt_<k>/<local rank>/
    error.json, written by the real ErrorHandler; None: the rank left no file (killed)."""
    for rank, error in errors.items():
        where = log_dir / "job-uid_abc" / f"attempt_{k}" / str(rank)
        where.mkdir(parents=True)
        if error is not None:
            _error_file(where, error)


def _own(log_dir: Path, reused: list[str] | None = None) -> int | None:
    """How many of the pod's failures of its own torchrun restarted after (their rounds)."""
    rounds = own_failure_rounds(log_dir, reused or [])
    return None if rounds is None else len(rounds)


def test_own_failure_restarts_leave_out_the_peers_that_left(tmp_path: Path) -> None:
    """torch restarts (and counts against --max-restarts) a group whose peer left as one that
    failed: only the attempts that failed of this pod's own are the job's failures."""
    peer = RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:1")
    _attempt(tmp_path, 0, {0: peer})  # a peer preempted: a membership change
    _attempt(tmp_path, 1, {0: None})  # SIGKILLed: no error file, its own failure
    _attempt(tmp_path, 2, {0: peer, 1: ValueError("bad row")})  # one local rank raised
    _attempt(tmp_path, 3, {0: peer})  # the peer left again
    _attempt(tmp_path, 4, {0: ValueError("bad row")})  # the last: the report's own kind
    assert _own(tmp_path) == 2
    assert _own(tmp_path / "absent") is None


def test_an_attempt_is_named_by_its_round_else_by_the_launcher_alone(tmp_path: Path) -> None:
    """The id the round's trainers left (the same in every pod of the round: one restart of
    the job however many pods failed in it); an attempt whose ranks died before the group
    agreed on one (or left a malformed id) gets one of this launcher's and attempt's alone."""
    from finetune_trainer import launch

    for pod in ("pod-a", "pod-b"):
        _attempt(tmp_path / pod, 0, {0: ValueError("bad row"), 1: None})
        (tmp_path / pod / "job-uid_abc" / "attempt_0" / "1" / ROUND_FILE).write_text("9f3c\n")
    rounds = {attempt_round(tmp_path / p / "job-uid_abc" / "attempt_0") for p in ("pod-a", "pod-b")}
    assert rounds == {"9f3c"}
    _attempt(tmp_path, 1, {0: None})
    assert attempt_round(tmp_path / "job-uid_abc" / "attempt_1") == f"p{launch._LAUNCH_ID}-1"
    (tmp_path / "job-uid_abc" / "attempt_1" / "0" / ROUND_FILE).write_text("not an id!")
    assert attempt_round(tmp_path / "job-uid_abc" / "attempt_1") == f"p{launch._LAUNCH_ID}-1"


def test_a_collective_timeout_counts_as_the_pods_failure(tmp_path: Path) -> None:
    """A hung rank: its peers' collectives time out (a lost peer for the root cause), but
    nothing else would ever count a hang that recurs at every attempt; a peer that closed its
    connections did fail of its own in its pod, where it is counted."""
    timed_out = RuntimeError("[gloo] Timed out waiting 300000ms for recv operation to complete")
    _attempt(tmp_path, 0, {0: timed_out})
    _attempt(tmp_path, 1, {0: RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:1")})
    _attempt(tmp_path, 2, {0: timed_out})  # the last: torchrun gave up
    assert _own(tmp_path) == 1


def test_an_own_failure_torch_restarted_as_a_membership_change_still_counts(
    tmp_path: Path,
) -> None:
    """A rank raised, but before it exited its peer pod's agent already waited at the next
    round: torch restarts the group as a membership change, with the same restart count, and
    its real DefaultLogsSpecs wipes attempt_0 (the error file) to start the group there again
    (the maxRestarts 3 run that reported 2 of its 3 restarts). The launcher reads it first."""
    specs = DefaultLogsSpecs(log_dir=str(tmp_path))
    reify = DefaultLogsSpecs.reify

    def start(k: int) -> Path:  # what torch's agent passes: each local rank's environment
        env = {"TORCHELASTIC_RUN_ID": "job-uid", "TORCHELASTIC_RESTART_COUNT": str(k)}
        return Path(specs.reify({0: env, 1: env}).error_files[1]).parent

    with reused_attempts() as reused:
        _error_file(start(0), ValueError("bad row"))  # raised; restarted as a membership change
        _error_file(start(0), ValueError("bad row"))  # raised again: a failure, count 1
        start(1)  # a real membership change: the group stopped, no error file: not counted
        _error_file(start(1), ValueError("bad row"))  # raised: torchrun gave up
    assert len(reused) == 1 and reused[0].endswith("-0r0")  # no round file: its own id
    assert _own(tmp_path, reused) == 2
    assert _own(tmp_path) == 1  # what the attempts left on disk say alone
    assert DefaultLogsSpecs.reify is reify  # torch's own again once torchrun returned


def test_a_rank_that_stopped_for_a_peer_is_not_a_failure_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank whose peer was told to stop exits 75 with no exception: the error file it now
    writes (record_peer_stop, the real ErrorHandler) makes its attempt a peer's departure, not
    a kill (no file) of the pod's own; seen in the fault suite, where it counted a preemption
    of the other pod as a failure of this one."""
    where = tmp_path / "run_x" / "attempt_0" / "0"
    where.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(where / "error.json"))
    record_peer_stop()
    assert "PeerStopped" in json.loads((where / "error.json").read_text())["message"]["message"]
    (tmp_path / "run_x" / "attempt_1" / "0").mkdir(parents=True)  # the running group
    assert _own(tmp_path) == 0
    (where / "error.json").unlink()  # without it: a kill, its own
    assert _own(tmp_path) == 1


def test_each_group_started_is_told_the_pods_own_failures_so_far(tmp_path: Path) -> None:
    """The count and the rounds the trainers export while they run (the operator's live
    feed): set in the environment torch's agent starts each worker group with, from the
    attempts before it and the ones torch restarted as membership changes."""
    from finetune_trainer import launch

    specs = DefaultLogsSpecs(log_dir=str(tmp_path))
    told: list[int] = []
    rounds: list[str] = []

    def start(k: int) -> Path:
        envs = {r: {"TORCHELASTIC_RUN_ID": "job-uid", "TORCHELASTIC_RESTART_COUNT": str(k)}
                for r in (0, 1)}  # fmt: skip
        where = Path(specs.reify(envs).error_files[1]).parent
        assert envs[0][OWN_ROUNDS_ENV] == envs[1][OWN_ROUNDS_ENV]  # every local rank
        rounds.append(envs[0][OWN_ROUNDS_ENV])
        told.append(len(parse_rounds(rounds[-1])))  # what the trainer exports as the count
        return where

    peer = RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:1")
    with reused_attempts():
        first = start(0)
        (first / ROUND_FILE).write_text("ra")  # the round's id, as the trainer leaves it
        _error_file(first, ValueError("bad row"))  # raised: restarted as a membership change
        again = start(0)
        (again / ROUND_FILE).write_text("rb")
        _error_file(again, ValueError("bad row"))  # raised again: a failure, count 1
        start(1)  # killed before its group agreed on a round: a failure of its own, alone
        _error_file(start(2), peer)  # only lost a peer: restarted, not its own
        start(3)  # the group that runs now
    assert told == [0, 1, 2, 3, 3]
    alone = f"p{launch._LAUNCH_ID}-1"
    assert rounds == ["", "ra", "ra,rb", f"ra,rb,{alone}", f"ra,rb,{alone}"]


@pytest.mark.parametrize("end", ["SIGTERM", "RendezvousClosed"])
def test_the_launcher_carries_its_own_failures_out_when_the_pod_ends_another_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """A pod that failed twice of its own, then was preempted (SIGTERM: torchrun's real
    SignalException) or found the rendezvous shut down by an agent that gave up: no crash
    report, but its 2 restarts go to the termination log beside the trainer's final report,
    for the job's one budget; its end is still a stop (143, no crash) or torchrun's error."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    from finetune_trainer import launch

    log = tmp_path / "termination-log"
    log.touch()
    monkeypatch.setattr(launch, "refused", lambda _: None)  # no worker refused its config
    monkeypatch.setenv("FT_TERMINATION_LOG", str(log))
    peer = RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:1")

    def torchrun(args: list[str]) -> None:
        log_dir = Path(next(a for a in args if a.startswith("--log-dir=")).split("=", 1)[1])
        _attempt(log_dir, 0, {0: ValueError("bad row")})  # its own: restarted
        _attempt(log_dir, 1, {0: peer})  # a peer left: restarted, not counted
        _attempt(log_dir, 2, {0: None, 1: ValueError("bad row")})  # its own again
        _attempt(log_dir, 3, {0: None})  # the running group, stopped: not restarted
        (log_dir / "job-uid_abc" / "attempt_2" / "1" / ROUND_FILE).write_text("r2")
        if end == "SIGTERM":
            write_final_report(step=7, loss=1.5, checkpoint_step=6, rank=0, stop_reason="Signal")
            raise SignalException("stopped", signal.SIGTERM)
        raise RendezvousClosedError()

    monkeypatch.setattr(launch, "torchrun_main", torchrun)
    argv = ["--nnodes=1:2", "--max-restarts=3", "-m", "finetune_trainer", "--config", "/none"]
    # attempt 0's ranks died before their group agreed on a round id: the launcher's own.
    rounds = [f"p{launch._LAUNCH_ID}-0", "r2"]
    if end == "SIGTERM":
        assert launch.main(argv) == 143
        report = json.loads(log.read_text())
        assert report == {
            "step": 7, "rank": 0, "loss": 1.5, "checkpointStep": 6,
            "stopReason": "Signal", "restarts": 2, "rounds": rounds,
        }  # fmt: skip
    else:
        with pytest.raises(RendezvousClosedError):
            launch.main(argv)
        assert json.loads(log.read_text()) == {
            "restarts": 2, "rounds": rounds, "rendezvousClosed": True,
        }  # fmt: skip

    # No failure of its own before the stop: nothing written (a preemption as before).
    log.write_text("")

    def quiet(args: list[str]) -> None:
        log_dir = Path(next(a for a in args if a.startswith("--log-dir=")).split("=", 1)[1])
        _attempt(log_dir, 0, {0: peer})
        _attempt(log_dir, 1, {0: None})
        raise SignalException("stopped", signal.SIGTERM)

    monkeypatch.setattr(launch, "torchrun_main", quiet)
    assert launch.main(argv) == 143
    assert log.read_text() == ""


def test_the_carried_restarts_stay_within_the_limit_and_never_beside_a_crash(
    tmp_path: Path,
) -> None:
    from finetune_trainer.termination_log import MAX_BYTES, write_restarts

    log = tmp_path / "termination-log"
    log.write_text(json.dumps({"step": 3, "rank": 0, "output": "x" * 5000}))
    assert write_restarts(["a", "b", "c", "d"], path=str(log))
    text = log.read_text()
    assert len(text.encode()) <= MAX_BYTES and json.loads(text)["restarts"] == 4
    assert json.loads(text)["rounds"] == ["a", "b", "c", "d"]
    crash = {"crash": {"rank": 0, "kind": KIND_EXCEPTION, "message": "m", "restarts": 1}}
    log.write_text(json.dumps(crash))
    assert not write_restarts(["a"], path=str(log))
    assert json.loads(log.read_text()) == crash
    assert not write_restarts(["a"], path=str(tmp_path / "absent"))


def test_the_launcher_gives_torchrun_a_log_dir_of_its_own() -> None:
    argv = ["--nnodes=1", "--max-restarts=2", "-m", "finetune_trainer", "--config", "/c"]
    run, log_dir = with_log_dir(argv)
    assert log_dir is not None and log_dir.is_dir()
    assert run == [*argv[:2], f"--log-dir={log_dir}", *argv[2:]]
    log_dir.rmdir()
    given = ["--log-dir=/x", "-m", "finetune_trainer"]
    assert with_log_dir(given) == (given, None)  # the caller's own is kept
