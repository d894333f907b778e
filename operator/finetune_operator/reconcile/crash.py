"""Why a worker crashed, in a line for the job's conditions and Events (pure).

The evidence, from the pod's `state.terminated`:
- `message`: the trainer's crash report (`{"crash": {...}}`, written by its launcher from
  torchelastic's error files: finetune_trainer/crash.py), or, where the trainer failed before
  it could write one, the log's tail the kubelet put there (`FallbackToLogsOnError`);
- `reason`: `OOMKilled` when the container went over its memory limit (the kubelet's own).
Kubernetes caps neither a condition's nor an Event's message usefully for a reader, so every
line here is bounded (MAX_CAUSE_CHARS), and the status's messages stay well under 1 KiB.
"""

from __future__ import annotations

import json
import re
import signal
from typing import Any

MAX_CAUSE_CHARS = 400
REASON_OOM_KILLED = "OOMKilled"
KIND_PEER_LOST = "PeerLost"  # finetune_trainer/crash.py: its ranks only lost a peer
# The last line of a Python traceback: `pkg.ErrorType: message` (or a bare type).
_EXCEPTION_LINE = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure))(?::\s*(?P<text>.*))?$"
)
# torchrun's own wrappers around a worker's failure: never the cause themselves.
_WRAPPERS = ("ChildFailedError", "SignalException")


def shorten(text: str, limit: int = MAX_CAUSE_CHARS) -> str:
    """One line of at most `limit` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _report(message: str | None) -> dict[str, Any] | None:
    """The trainer's JSON report, if `message` is one (a log's tail is not)."""
    try:
        data = json.loads(message or "")
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _crash(message: str | None) -> dict[str, Any] | None:
    crash = (_report(message) or {}).get("crash")
    return crash if isinstance(crash, dict) else None


def describe_crash_report(crash: dict[str, Any]) -> str:
    """ "rank 3: RuntimeError: expected ... (trainer.py:212)"; an accelerator OOM adds what the
    plan predicted ("[planned 61.2 GiB per GPU of 79.1 GiB]"). Only the message is cut."""
    rank = crash.get("rank")
    text = str(crash.get("message") or crash.get("kind") or "crashed")
    prefix = f"rank {rank}: " if isinstance(rank, int) else ""
    planned, where = crash.get("planned"), crash.get("location")
    suffix = f" [{shorten(planned, 100)}]" if isinstance(planned, str) and planned else ""
    suffix += f" ({shorten(where, 100)})" if isinstance(where, str) and where else ""
    return prefix + shorten(text, MAX_CAUSE_CHARS - len(prefix) - len(suffix)) + suffix


def describe_log_tail(tail: str, *, last_line: bool = True) -> str | None:
    """The last exception a log's tail shows (a traceback's last line), else (`last_line`)
    its last line that is not a JSON record (the trainer's step lines say nothing of a crash)."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for line in reversed(lines):
        match = _EXCEPTION_LINE.match(line)
        if match and not match["type"].endswith(_WRAPPERS):
            return shorten(line)
    text = [line for line in lines if not line.startswith("{")]
    return shorten(text[-1]) if text and last_line else None


def is_peer_loss(message: str | None) -> bool:
    """The pod's ranks failed only because a peer in another pod vanished: a consequence,
    never the job's root cause while another pod's report names one."""
    crash = _crash(message)
    return crash is not None and crash.get("kind") == KIND_PEER_LOST


# The trainer's CollectiveTimeoutError and the timeouts it wraps (finetune_trainer/distributed.py).
COLLECTIVE_TIMEOUT_MARKERS = (
    "a collective timed out",
    "Timed out waiting",
    "collective operation timeout",
)


def is_collective_timeout(message: str | None) -> bool:
    """The pod's ranks lost a peer by a collective timing out (a hung rank, or a peer that
    vanished without closing its connections): counted as a failure (reconcile/budget.py),
    or a hang that recurs at every attempt would never spend the budget."""
    text = str((_crash(message) or {}).get("message") or "")
    return is_peer_loss(message) and any(m in text for m in COLLECTIVE_TIMEOUT_MARKERS)


def has_crash_report(message: str | None) -> bool:
    """The pod's torchrun gave up on a failed worker group and its launcher said why (which
    shuts the job's rendezvous down: reconcile/budget.py)."""
    return _crash(message) is not None


def rendezvous_closed(message: str | None) -> bool:
    """The pod's torchrun ended because the job's rendezvous was shut down (another agent gave
    up: reconcile/budget.py): its log's last exception is torch's RendezvousClosedError."""
    report = _report(message)
    if report is not None:
        # A launcher that had restarted after failures of its own says so in a report of its
        # own, which hides the log's tail (FallbackToLogsOnError): it names the error too.
        return report.get("rendezvousClosed") is True
    line = describe_log_tail(message or "", last_line=False) or ""
    return line.split(":", 1)[0].endswith("RendezvousClosedError")


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def carried_restarts(message: str | None) -> int | None:
    """How many times the pod's torchrun restarted its worker group after a failure of its own
    before the pod ended another way (preempted, stopped by a signal, the rendezvous closed:
    `restarts` at the report's top level, finetune_trainer/launch.py), else before it gave up
    (`restarts` in its crash report); None when it says neither (it never restarted after a
    failure of its own, killed from outside, or an older trainer image)."""
    top = _count((_report(message) or {}).get("restarts"))
    return top if top is not None else _count((_crash(message) or {}).get("restarts"))


_ROUND_ID = re.compile(r"[0-9A-Za-z_.:-]{1,64}")
MAX_ROUNDS = 32  # the launcher's bound (finetune_trainer.crash.MAX_ROUNDS)


def _round_ids(value: object) -> tuple[str, ...] | None:
    if not isinstance(value, list):
        return None
    return tuple(v for v in value if isinstance(v, str) and _ROUND_ID.fullmatch(v))[-MAX_ROUNDS:]


def carried_rounds(message: str | None) -> tuple[str, ...] | None:
    """The rendezvous rounds of the failures of the pod's own its torchrun restarted after
    (`rounds` at the report's top level when the pod ended another way, else in its crash
    report: finetune_trainer/launch.py); None when the report names none (no report, or a
    trainer image that says only the count: `carried_restarts`)."""
    top = _round_ids((_report(message) or {}).get("rounds"))
    return top if top is not None else _round_ids((_crash(message) or {}).get("rounds"))


def end_round(message: str | None) -> str | None:
    """The round of the failure that ended the pod (`round` in its crash report), None when
    its report names none."""
    value = (_crash(message) or {}).get("round")
    return value if isinstance(value, str) and _ROUND_ID.fullmatch(value) else None


def describe_oom_kill(memory_limit: str | None) -> str:
    limit = f" ({memory_limit})" if memory_limit else ""
    return f"{REASON_OOM_KILLED}: the pod exceeded resources.memory{limit}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def crash_cause(
    message: str | None,
    reason: str | None = None,
    memory_limit: str | None = None,
    exit_code: int | None = None,
) -> str | None:
    """Why the container failed, from its termination `message`, `reason` and `exit_code`;
    None when they say nothing more than the exit code."""
    parts: list[str] = []
    # 128 + N: the container's main process was killed by signal N (the pod's processes
    # SIGKILLed, say): the log's last line is whatever it was doing, not why it ended.
    killed = exit_code is not None and 128 < exit_code < 160
    if reason == REASON_OOM_KILLED:
        parts.append(describe_oom_kill(memory_limit))
    crash = _crash(message)
    if crash is not None:
        parts.append(describe_crash_report(crash))
    elif message and _report(message) is None:
        # Not a report (a final report or a configuration error): a log's tail.
        cause = describe_log_tail(message, last_line=not killed)
        if cause:
            parts.append(cause)
    if not parts and killed and exit_code is not None:
        parts.append(f"killed by {_signal_name(exit_code - 128)}")
    return "; ".join(parts) or None
