"""A crashed worker group's root cause, shaped for the container's termination log.

The mechanism is torchelastic's own: each rank runs under `errors.record` (`recorded` below),
whose error handler writes `TORCHELASTIC_ERROR_FILE` (the exception's type and message, the
traceback, a timestamp); torchrun collects one `ProcessFailure` per failed rank (exit code,
error-file data, or the signal that killed it) into the `ChildFailedError` it raises. The
launcher (launch.py) picks the root cause and writes the report built here, which the operator
turns into the job's Restarting/Failed message (reconcile/crash.py).

Report: {"crash": {"rank", "kind", "message", "exception"?, "location"?, "traceback"?,
"planned"?, "exitCode", "signal"?, "time", "failedRanks"}}, beside whatever final report a trainer left. Kinds: `OutOfMemory` (an accelerator OOM; `planned`
says what the plan predicted per GPU), `Signal` (a rank killed by a signal: SIGKILL from the
kernel's OOM killer, SIGSEGV...), `Exception` (any other exception), `PeerLost` (every rank
here failed only because a peer elsewhere vanished: the cause is in another pod's report),
`Exit` (a non-zero exit
with no error file: it failed before its handler ran, or exited with a code of its own after
writing its own report; the launcher then leaves the termination log alone, so the trainer's
report stands or, on an empty one, the kubelet's `FallbackToLogsOnError` takes the log's tail,
which holds the traceback).
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, ParamSpec, TypeVar

KIND_OUT_OF_MEMORY = "OutOfMemory"
KIND_SIGNAL = "Signal"
KIND_EXCEPTION = "Exception"
KIND_EXIT = "Exit"
KIND_PEER_LOST = "PeerLost"

# The launcher tells each trainer it starts which rendezvous rounds its torchrun's restarts so
# far followed a failure of the pod's own in (launch.reused_attempts: comma-separated round
# ids, at most MAX_ROUNDS, the newest); the trainer exports them on its metrics
# (finetune_trainer_own_failure_round, and their count), where the operator counts each round
# once, however many pods failed in it (reconcile/budget.py).
OWN_ROUNDS_ENV = "FT_OWN_FAILURE_ROUNDS"
MAX_ROUNDS = 32  # a job fails at maxRestarts + 1 failed rounds; more never matter
# The round id a trainer writes next to its error file (`<attempt>/<local rank>/round_id`),
# where the launcher reads it for each attempt (launch.attempt_round).
ROUND_FILE = "round_id"
ROUND_ID_RE = re.compile(r"[0-9A-Za-z_.:-]{1,64}")

MAX_REPORT_BYTES = 4096  # what the kubelet keeps of a termination message
MAX_FAILED_RANKS = 16
TRACEBACK_FRAMES = 2  # the last frames kept: where it was raised, and its caller
OUR_PACKAGE = "finetune_trainer"
NOT_AVAILABLE = "<N/A>"  # torchelastic's ProcessFailure.error_file when a rank left none
# Errors a rank sees because a *peer* failed first: never the root cause when a rank that
# raised something else (or was killed) failed in the same round.
PEER_LOSS_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "DistNetworkError",
    "DistStoreError",
    "NCCL communicator was aborted",
    "Broken pipe",
    # A rank that stopped with a peer that was told to stop (PeerStopped, below).
    "PeerStopped",
    # A collective that waited past its timeout: a peer stopped answering without closing its
    # connections (gloo's message; the trainer's CollectiveTimeoutError carries it).
    "Timed out waiting",
    "collective operation timeout",
    # The start-up barrier's (finetune_trainer.startup_barrier): a peer that stopped beating,
    # one that beats without progress (stuck: it ends itself with its own error), or one
    # alive but starting past the limit, carries no torch message.
    "CollectiveTimeoutError",
)
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, kw_only=True)
class RankFailure:
    """What torchrun knows of one failed rank (a `ProcessFailure`, flattened)."""

    rank: int
    exitcode: int  # negative: killed by that signal
    message: str = ""  # "Type: text" from the error file; "" without one
    traceback: str = ""
    timestamp: int = 0
    has_error_file: bool = False

    @property
    def peer_loss(self) -> bool:
        return any(m in self.message for m in PEER_LOSS_MARKERS)


def failure_from_process(rank: int, failure: Any) -> RankFailure:
    """Flatten a torchelastic `ProcessFailure` (its error-file message is a dict or a str)."""
    message: Any = failure.message
    has_file = failure.error_file != NOT_AVAILABLE
    traceback = ""
    if isinstance(message, Mapping):
        traceback = str((message.get("extraInfo") or {}).get("py_callstack") or "")
        message = message.get("message") or ""
    return RankFailure(
        rank=rank,
        exitcode=int(failure.exitcode),
        message=str(message) if has_file else "",
        traceback=traceback,
        timestamp=int(failure.timestamp),
        has_error_file=has_file,
    )


def root_cause(failures: Sequence[RankFailure]) -> RankFailure:
    """The first failure, as torchelastic's `get_first_failure`, but a rank that failed only
    because a peer vanished never outranks one that raised or was killed: timestamps are whole
    seconds, and a killed rank's is when torchrun noticed, after its peers' errors."""
    return min(failures, key=lambda f: (f.peer_loss, f.timestamp, f.rank))


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _frames(traceback: str) -> list[tuple[int, re.Match[str]]]:
    lines = traceback.splitlines()
    return [(i, m) for i, line in enumerate(lines) if (m := _FRAME.match(line))]


def locate(traceback: str) -> str | None:
    """`file.py:line` of the deepest frame in the trainer's own code (else the deepest)."""
    frames = [m for _, m in _frames(traceback)]
    if not frames:
        return None
    ours = [m for m in frames if OUR_PACKAGE in PurePath(m["path"]).parts]
    frame = (ours or frames)[-1]
    return f"{PurePath(frame['path']).name}:{frame['line']}"


def traceback_tail(traceback: str, frames: int = TRACEBACK_FRAMES) -> str:
    """The last `frames` frames with their source lines, without the final exception line
    (the report's message has it)."""
    lines = traceback.rstrip("\n").splitlines()
    found = _frames(traceback)
    if not found:
        return ""
    start = found[-frames][0] if len(found) >= frames else found[0][0]
    tail = lines[start:]
    while tail and not tail[-1].startswith((" ", "\t")):
        tail.pop()  # "RuntimeError: ..." (possibly several lines): it is the message
    return "\n".join(tail)


def qualified_type(failure: RankFailure) -> str | None:
    """`torch.OutOfMemoryError` from the traceback's last line, else the bare type name."""
    bare = failure.message.split(":", 1)[0].strip() if ":" in failure.message else ""
    if not bare or not re.fullmatch(r"[A-Za-z_][\w.]*", bare):
        return None
    for line in reversed(failure.traceback.splitlines()):
        head = line.split(":", 1)[0].strip()
        if head == bare or head.endswith("." + bare):
            return head
    return bare


def is_out_of_memory(exception: str | None, message: str) -> bool:
    if exception is not None and exception.rsplit(".", 1)[-1] == "OutOfMemoryError":
        return True
    return "out of memory" in message.lower()  # a CUDA runtime error re-raised as RuntimeError


def crash_report(failures: Sequence[RankFailure], *, planned: str | None = None) -> dict[str, Any]:
    """The termination-log report of a failed worker group (`failures`: non-empty), at most
    MAX_REPORT_BYTES as JSON. `planned`: the plan's predicted memory, added to an OOM."""
    root = root_cause(failures)
    crash: dict[str, Any] = {"rank": root.rank, "exitCode": root.exitcode, "time": root.timestamp}
    if root.exitcode < 0:
        name = _signal_name(root.exitcode)
        hint = {
            "SIGKILL": " (the kernel's OOM killer, or a kill from outside the pod)",
            # NCCL's watchdog aborts the process when a collective times out.
            "SIGABRT": " (on GPUs: NCCL's watchdog, when a collective timed out or a peer was "
            "lost; the pod's log says which)",
        }.get(name, "")
        crash.update(kind=KIND_SIGNAL, signal=name, message=f"died of {name}{hint}")
    elif not root.has_error_file:
        crash.update(
            kind=KIND_EXIT,
            message=f"exited with code {root.exitcode} before its error handler ran "
            "(a failure at start-up: the pod's log has it)",
        )
    else:
        exception = qualified_type(root)
        oom = is_out_of_memory(exception, root.message)
        kind = KIND_OUT_OF_MEMORY if oom else KIND_PEER_LOST if root.peer_loss else KIND_EXCEPTION
        crash.update(kind=kind, message=root.message)
        if oom and planned:
            crash["planned"] = planned  # its own key: a long CUDA message is cut, never this
        if exception:
            crash["exception"] = exception
        where = locate(root.traceback)
        if where:
            crash["location"] = where
        tail = traceback_tail(root.traceback)
        if tail:
            crash["traceback"] = tail
    crash["failedRanks"] = sorted(f.rank for f in failures)[:MAX_FAILED_RANKS]
    return fit_report({"crash": crash})


def _size(report: Mapping[str, Any]) -> int:
    return len(json.dumps(report).encode())


def fit_report(report: dict[str, Any], limit: int = MAX_REPORT_BYTES) -> dict[str, Any]:
    """The report within `limit` bytes of JSON: the traceback loses its first lines, then the
    message its end; the kind, exception type, location and rank always stay. Keys other
    than `crash` are kept as they are."""
    crash = dict(report["crash"])
    out = {**report, "crash": crash}
    while _size(out) > limit and crash.get("traceback"):
        lines = crash["traceback"].splitlines()
        if len(lines) > 1:
            crash["traceback"] = "\n".join(lines[1:])
        else:
            del crash["traceback"]
    if _size(out) > limit:
        message = str(crash.get("message", ""))
        # The longest prefix that fits (JSON escapes make bytes per character vary).
        low, high = 0, len(message)
        while low < high:
            mid = (low + high + 1) // 2
            crash["message"] = message[:mid] + "…"
            low, high = (mid, high) if _size(out) <= limit else (low, mid - 1)
        crash["message"] = message[:low] + "…"
    return out


def planned_memory_note(plan: Any) -> str | None:
    """ "planned X GiB per GPU of Y GiB" from a job.json `Plan` (None when it planned none)."""
    total = int(plan.memory.total)
    if total <= 0:
        return None
    unit = "GPU" if plan.device == "gpu" else "process"
    gib = 2**30
    return f"planned {total / gib:.1f} GiB per {unit} of {plan.gpu_memory_bytes / gib:.1f} GiB"


def recorded(fn: Callable[P, R]) -> Callable[P, R | None]:
    """`fn` under torchelastic's `errors.record` (torch imported at the first call, not at
    import: the entry point sets logging up first)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(fn)(*args, **kwargs)

    return wrapper


class PeerStopped(Exception):
    """This rank stopped because a peer was told to stop (its pod is going away), and exits
    non-zero (finish.EXIT_PEER_STOPPED) so that torchrun re-forms the group without it."""


def record_peer_stop() -> None:
    """Say in this rank's error file that it stopped for a peer: an exit without an
    exception leaves none, and an attempt without one reads as a kill, a failure of the pod's
    own (launch._own_failure), which would spend the job's restart budget on a departure."""
    try:
        raise PeerStopped(
            "a peer was told to stop (its pod is going away); this rank stopped with it after "
            "the final checkpoint, so that torchrun re-forms the group without the peer"
        )
    except PeerStopped as e:
        record_exception(e)


def write_round_id(round_id: str, error_file: str | None = None) -> bool:
    """Leave this worker group's round id (startup_barrier.agree_round_id) next to this rank's
    torchelastic error file, where its launcher reads it once the attempt failed; never raises
    (no error file set: not under torchrun, nothing to tell)."""
    target = error_file or os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not target:
        return False
    try:
        path = Path(target).parent / ROUND_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(round_id)
    except OSError:
        return False
    return True


def parse_rounds(raw: str | None) -> tuple[str, ...]:
    """Pure: `OWN_ROUNDS_ENV`'s value as round ids (anything malformed dropped)."""
    return tuple(r for r in (raw or "").split(",") if ROUND_ID_RE.fullmatch(r))[-MAX_ROUNDS:]


def record_exception(error: BaseException) -> None:
    """Write `error` to this rank's error file now, as `record` would on the way out: for a
    path that ends with `os._exit` (stuck save threads), which `record` never sees. Call it
    inside the `except` block (the traceback is the one being handled). Never raises."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(error)
    except Exception:  # the report is best effort, the exit must happen
        pass
