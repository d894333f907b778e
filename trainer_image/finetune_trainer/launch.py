"""The worker pod's command: torchrun (`torch.distributed.run`), stopping quietly on a signal
and saying why on a crash.

    python -m finetune_trainer.launch <torchrun arguments> -m finetune_trainer --config ...

torchrun turns SIGTERM (every graceful pod delete, drain or preemption) into a
`SignalException`, forwards the signal to its workers and shuts them down, then lets the
exception escape: a traceback in the pod's log and exit code 1 for what is an orderly stop.
Here that stop ends with one log line and 128 + the signal (143 for SIGTERM), the code the
trainer itself exits with when stopped (`finish.EXIT_STOPPED`) and that
`reconcile/disposition.py` reads as a preemption.

A failed worker group ends torchrun with a `ChildFailedError` carrying each failed rank's
error file (the trainer runs under torchelastic's `record`) or the signal that killed it.
Its root cause goes to the container's termination log (finetune_trainer/crash.py), where
the operator reads it for the job's status and Events; torchrun's own summary of the failures
goes to the log, followed by our root cause (which says so when torchrun's pick differs), and
the exit code stays 1. Any other failure is torchrun's own, unchanged.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from finetune_trainer.crash import (
    KIND_EXIT,
    KIND_PEER_LOST,
    RankFailure,
    crash_report,
    failure_from_process,
    planned_memory_note,
)
from finetune_trainer.refusal import EXIT_CONFIG_ERROR, arm, disarm, refused
from finetune_trainer.termination_log import write_crash_report

EXIT_FAILED = 1  # what torchrun exits with on a failed worker group


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


def report_crash(error: ChildFailedError, argv: list[str]) -> str | None:
    """Write the root cause to the termination log; the line for the pod's log, None when the
    report would say less than the log (`KIND_EXIT`)."""
    failures = [failure_from_process(rank, f) for rank, f in error.failures.items()]
    report = crash_report(failures, planned=_planned(argv))
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
    try:
        torchrun_main(args)
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
        name = signal.Signals(e.sigval).name
        # torchrun already logged the signal and shut its workers down, waiting for them.
        print(f"torchrun stopped by {name}: worker group shut down", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        line = report_crash(e, args)
        # torchrun's own summary (each failed rank's traceback, its pick of the root cause),
        # as it would print it, without the launcher's frames around it; then ours, last.
        print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if line:
            print(line, file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        disarm(refusal)
    return 0


if __name__ == "__main__":
    sys.exit(main())
