"""The worker pod's command: torchrun (`torch.distributed.run`), stopping quietly on a signal
and saying why on a crash.

    python -m finetune_trainer.launch <torchrun arguments> -m finetune_trainer --config ...

torchrun turns SIGTERM (every graceful pod delete, drain or preemption) into a
`SignalException`, forwards the signal to its workers and shuts them down, then lets the
exception escape: a traceback in the pod's log and exit code 1 for what is an orderly stop.
Here that stop ends with one log line and 128 + the signal (143 for SIGTERM), the code the
trainer itself exits with when stopped (`finish.EXIT_STOPPED`) and that
`reconcile/disposition.py` reads as a preemption. Restarts torchrun made after failures of the
pod's own before the stop go to the termination log (`carry_restarts`): they spend the job's
one restart budget however the pod ends (a RendezvousClosedError's too).

A failed worker group ends torchrun with a `ChildFailedError` carrying each failed rank's
error file (the trainer runs under torchelastic's `record`) or the signal that killed it.
Its root cause goes to the container's termination log (finetune_trainer/crash.py), where
the operator reads it for the job's status and Events; torchrun's own summary of the failures
goes to the log, followed by our root cause (which says so when torchrun's pick differs), and
the exit code stays 1. Any other failure is torchrun's own, unchanged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.run import main as torchrun_main

from finetune_trainer.crash import (
    KIND_EXIT,
    KIND_PEER_LOST,
    MAX_ROUNDS,
    OWN_ROUNDS_ENV,
    PEER_LOSS_MARKERS,
    ROUND_FILE,
    ROUND_ID_RE,
    RankFailure,
    crash_report,
    failure_from_process,
    planned_memory_note,
)
from finetune_trainer.distributed import COLLECTIVE_TIMEOUT_MARKERS
from finetune_trainer.refusal import EXIT_CONFIG_ERROR, arm, disarm, refused
from finetune_trainer.termination_log import write_crash_report, write_restarts

EXIT_FAILED = 1  # what torchrun exits with on a failed worker group
# Names this launcher's attempts that have no round id (their ranks died before the group
# agreed on one): each such failure is this pod's alone, and counts alone.
_LAUNCH_ID = uuid.uuid4().hex[:8]


def config_path(argv: list[str]) -> str:
    """The trainer's `--config` among torchrun's arguments (the last one: the program's)."""
    # Only on a crash: the API package imports pydantic, which the agent does not need.
    from finetune_operator.api.constants import CONFIG_PATH

    path = CONFIG_PATH
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
    return path


def _planned(argv: list[str]) -> str | None:
    try:
        from finetune_trainer.config import load_job_config

        return planned_memory_note(load_job_config(config_path(argv)).plan)
    except Exception:  # a crash report without the plan's figure is still one
        return None


def max_restarts(argv: list[str]) -> int:
    """torchrun's `--max-restarts` among its arguments (torchrun's default: 0). Only those
    before the program's module: the trainer's own arguments follow `-m`."""
    end = argv.index("-m") if "-m" in argv else len(argv)
    value = "0"
    for i, arg in enumerate(argv[:end]):
        name, eq, rest = arg.partition("=")
        if name in ("--max-restarts", "--max_restarts"):
            value = rest if eq else (argv[i + 1] if i + 1 < end else value)
    try:
        return max(0, int(value))
    except ValueError:
        return 0


LOG_DIR_FLAGS = ("--log-dir", "--log_dir")
_ATTEMPT = re.compile(r"attempt_(\d+)")


def with_log_dir(argv: list[str]) -> tuple[list[str], Path | None]:
    """torchrun's arguments with a `--log-dir` of our own, so that the attempts' error files
    can be read once it gives up (`own_failure_rounds`); unchanged when one is given or
    the program is not a module (`-m`: the flag must come before it)."""
    if "-m" not in argv:
        return argv, None
    end = argv.index("-m")
    if any(arg.partition("=")[0] in LOG_DIR_FLAGS for arg in argv[:end]):
        return argv, None
    log_dir = Path(tempfile.mkdtemp(prefix="torchelastic-"))
    return [*argv[:end], f"--log-dir={log_dir}", *argv[end:]], log_dir


def _error_message(path: Path) -> str:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):  # torchelastic's {"message": {"message": ..., ...}}
        message = message.get("message")
    return str(message or "")


def _counted(message: str) -> bool:
    """A rank's error that spends the job's budget: anything but a lost peer, and a collective
    that timed out (a hung rank, an NCCL peer that raised: nothing else ever counts a hang
    that recurs at every attempt; a peer that vanished silently counts too, which the ranks
    cannot tell from a hang)."""
    if any(m in message for m in COLLECTIVE_TIMEOUT_MARKERS):
        return True
    return not any(m in message for m in PEER_LOSS_MARKERS)


def _own_failure(attempt: Path) -> bool:
    """Whether this pod's worker group failed of its own in `attempt` (one of torchelastic's
    `<log dir>/<run>/attempt_<k>/` directories, `<local rank>/error.json` in it): a rank
    raised something other than a lost peer, or died without an error file (killed). A group
    whose every error is a lost peer failed because another pod failed (counted there) or a
    peer was taken away (a membership change: never counted)."""
    messages = [_error_message(f) for f in attempt.glob("*/error.json")]
    if not messages:
        return True
    return any(_counted(text) for text in messages)


def _raised_of_its_own(attempt: Path) -> bool:
    """A rank of this pod wrote an error that is not a lost peer (no "no file: killed" here:
    a group stopped by its agent for a membership change leaves no error file either)."""
    messages = [_error_message(f) for f in attempt.glob("*/error.json")]
    return any(text and _counted(text) for text in messages)


def attempt_round(attempt: Path, suffix: str = "") -> str:
    """The rendezvous round `attempt` ran in: the id its trainers agreed on and left next to
    their error files (startup_barrier.agree_round_id, crash.write_round_id), the same in
    every pod of the round. An attempt whose ranks died before that gets an id of this
    launcher's and this attempt's alone: its failure counts alone."""
    for path in sorted(attempt.glob(f"*/{ROUND_FILE}")):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if ROUND_ID_RE.fullmatch(text):
            return text
    return f"p{_LAUNCH_ID}-{attempt.name.removeprefix('attempt_')}{suffix}"


def _attempts(run_dir: Path) -> list[tuple[int, Path]]:
    return sorted(
        (int(m[1]), path)
        for path in run_dir.glob("attempt_*")
        if path.is_dir() and (m := _ATTEMPT.fullmatch(path.name))
    )


def _own_before(run_dir: Path, count: int) -> list[str]:
    """The rounds of the attempts before `count` in which this pod's group failed of its own
    (each was restarted: the restart count rises only on a restart)."""
    return [attempt_round(p) for k, p in _attempts(run_dir) if k < count and _own_failure(p)]


@contextmanager
def reused_attempts() -> Iterator[list[str]]:
    """The attempts that failed of this pod's own but that torch restarted as a membership
    change, whose error files it then wiped: their rounds (`attempt_round`), collected while
    torchrun runs in this process. Each worker group started meanwhile is told the rounds of
    the failures of the pod's own so far (`OWN_ROUNDS_ENV`: its trainers export them, so the
    operator counts a restart while the pod runs, not only once it gives up).

    torch's agent decides on its group's state at each monitor tick: a rank that raised but has
    not exited yet (it is tearing its process group down) leaves the group HEALTHY, and when a
    peer agent (whose ranks lost this one) already waits at the next rendezvous round, the
    agent restarts the group as a membership change: --max-restarts is not spent, the restart
    count stays, and DefaultLogsSpecs.reify wipes `attempt_<count>` (the raising rank's error
    file in it) before it starts the new group there. Read before it is wiped."""
    original = DefaultLogsSpecs.reify
    reused: list[str] = []

    def reify(self: DefaultLogsSpecs, envs: dict[int, dict[str, str]]) -> Any:
        run_dir = getattr(self, "_run_log_dir", None)
        count = (envs.get(0) or {}).get("TORCHELASTIC_RESTART_COUNT")
        if run_dir and count is not None:
            attempt = Path(run_dir) / f"attempt_{count}"
            if attempt.is_dir() and _raised_of_its_own(attempt):
                # Its directory is reused: a later failure at this count is another round.
                reused.append(attempt_round(attempt, f"r{len(reused)}"))
        own = reused + (_own_before(Path(run_dir), int(count)) if run_dir and count else [])
        for env in envs.values():  # the dicts the workers are started with, after this call
            env[OWN_ROUNDS_ENV] = ",".join(own[-MAX_ROUNDS:])
        return original(self, envs)

    DefaultLogsSpecs.reify = reify  # type: ignore[method-assign]
    try:
        yield reused
    finally:
        DefaultLogsSpecs.reify = original  # type: ignore[method-assign]


def _all_attempts(log_dir: Path) -> list[tuple[int, Path]]:
    return sorted(a for run in log_dir.iterdir() if run.is_dir() for a in _attempts(run))


def own_failure_rounds(log_dir: Path, reused: Sequence[str] = ()) -> list[str] | None:
    """The rounds of torchrun's restarts in this pod that followed a failure of the pod's own,
    out of all of them (torch also restarts, and counts against --max-restarts, a group whose
    peer left): one per attempt before the last that failed of its own, after `reused`: own
    failures torch restarted as membership changes (`reused_attempts`). The newest
    MAX_ROUNDS. None: no attempt found."""
    attempts = _all_attempts(log_dir) if log_dir.is_dir() else []
    if not attempts:
        return None
    own = [*reused, *(attempt_round(p) for _, p in attempts[:-1] if _own_failure(p))]
    return own[-MAX_ROUNDS:]


def last_round(log_dir: Path | None) -> str | None:
    """The round of the pod's last attempt (the one that ended the pod)."""
    attempts = _all_attempts(log_dir) if log_dir is not None and log_dir.is_dir() else []
    return attempt_round(attempts[-1][1]) if attempts else None


def carry_restarts(
    log_dir: Path | None, reused: Sequence[str] = (), *, rendezvous_closed: bool = False
) -> int:
    """The pod ends without a crash report (stopped by a signal, or the rendezvous shut down by
    another agent): its restarts after failures of its own still happened and spend the job's
    budget, so they go to the termination log (reconcile/budget.py `fold_ledger`); the
    pod's end stays what it was (a preemption, RendezvousClosed). The last attempt is the one
    stopped: only those before it were restarted. Nothing written when there were none (the
    log's tail stays the message: FallbackToLogsOnError). Returns the count."""
    own = own_failure_rounds(log_dir, reused) if log_dir is not None else None
    if own:
        write_restarts(own, rendezvous_closed=rendezvous_closed)
    return len(own or ())


def report_crash(
    error: ChildFailedError,
    argv: list[str],
    log_dir: Path | None = None,
    reused: Sequence[str] = (),
) -> str | None:
    """Write the root cause to the termination log; the line for the pod's log, None when the
    report would say less than the log (`KIND_EXIT`)."""
    failures = [failure_from_process(rank, f) for rank, f in error.failures.items()]
    report = crash_report(failures, planned=_planned(argv))
    # The restarts the operator counts against the job's one budget (reconcile/budget.py):
    # those after a failure of this pod's own, read from the attempts' error files. Without
    # them, all of torchrun's: it raises ChildFailedError only once its agent has no restart
    # left (torch's SimpleElasticAgent._invoke_run returns a failed group only at
    # remaining_restarts == 0), so it restarted the group --max-restarts times (fewer only
    # where a worker wedged in D-state made the agent drop its restarts: the count errs high).
    # A group that only lost a peer at the end claims none without the files: the operator
    # counts what a PeerLost pod reports too, and its restarts may all be peers that left.
    # Each with the round it failed in (`rounds`), and the round of the failure that ends the
    # pod (`round`): the operator counts a round once, however many pods failed in it.
    own = own_failure_rounds(log_dir, reused) if log_dir is not None else None
    if own is None:
        report["crash"]["restarts"] = (
            0 if report["crash"].get("kind") == KIND_PEER_LOST else max_restarts(argv)
        )
    else:
        report["crash"]["restarts"] = len(own)
        report["crash"]["rounds"] = own
    end = last_round(log_dir)
    if end is not None:
        report["crash"]["round"] = end
    # No error file and no signal: a trainer that failed before `record` ran (an import
    # error: the log's tail has it, FallbackToLogsOnError) or that exited with a code of its
    # own after writing its own report. Either says more than "exited with code N".
    if report["crash"]["kind"] == KIND_EXIT:
        return None
    write_crash_report(report)
    first = error.get_first_failure()[0]
    return crash_line(report, first, next(f for f in failures if f.rank == first))


def crash_line(report: dict[str, Any], first_rank: int, first: RankFailure) -> str:
    """Our root cause for the pod's log, printed after torchrun's summary so that the log's
    last word agrees with the termination log and the job's status. torchrun's "Root Cause"
    block is torchelastic's `get_first_failure` (the smallest whole-second timestamp), which
    can be a rank that only lost its peer, or stamp a killed rank after the peers it took
    down; we cannot change that block without faking its timestamps, so we say when it differs."""
    crash = report["crash"]
    where = f" ({crash['location']})" if crash.get("location") else ""
    line = f"crash report: rank {crash['rank']}: {crash['message']}{where}"
    if first_rank != crash["rank"]:
        # Otherwise both failed in the same second: ours breaks the tie by the lowest rank.
        why = "it only lost its peer" if first.peer_loss else "both failed in the same second"
        line += (
            f"\ncrash report: the root cause is rank {crash['rank']}, not rank {first_rank} "
            f'that torchrun\'s "Root Cause" above names ({why}: torchrun picks the earliest '
            "whole-second timestamp)"
        )
    if crash.get("kind") == KIND_PEER_LOST:
        # The operator names another pod's failure for the job (reconcile/crash.py): this
        # pod's log must not read as the job's root cause.
        line += (
            "\ncrash report: this pod's ranks only lost a peer in another pod: the job's "
            "root cause is that pod's failure, which the FineTuneJob's Restarting (or Failed) "
            "condition names"
        )
    return line


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # Each rendezvous round on a store of its own, hosted by worker rank 0 (the trainer's
    # start-up barrier counts on an empty one; without it torch 2.13 hangs a scale-up after a
    # scale-down): the worker pod and the image set it, a launcher run by hand too.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    refusal = arm()
    run_args, log_dir = with_log_dir(args)
    reused: list[str] = []
    try:
        with reused_attempts() as reused:
            torchrun_main(run_args)
    except SignalException as e:
        message = refused(refusal)
        if message is not None:
            # A worker refused the configuration and stopped us (refusal.py): its report is
            # in the termination log already; a restart would only refuse again.
            print(
                f"the trainer refused the job's configuration: {message}\n"
                "torchrun stopped without restarting the workers: every attempt would "
                "refuse the same way",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_CONFIG_ERROR
        carry_restarts(log_dir, reused)
        name = signal.Signals(e.sigval).name
        # torchrun already logged the signal and shut its workers down, waiting for them.
        print(f"torchrun stopped by {name}: worker group shut down", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        line = report_crash(e, args, log_dir, reused)
        # torchrun's own summary (each failed rank's traceback, its pick of the root cause),
        # as it would print it, without the launcher's frames around it; then ours, last.
        print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if line:
            print(line, file=sys.stderr, flush=True)
        return EXIT_FAILED
    except RendezvousClosedError:
        # Another agent gave up and shut the rendezvous down: torchrun's own error, unchanged.
        carry_restarts(log_dir, reused, rendezvous_closed=True)
        raise
    finally:
        disarm(refusal)
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
