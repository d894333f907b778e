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
from typing import Any

MAX_CAUSE_CHARS = 400
REASON_OOM_KILLED = "OOMKilled"
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


def _crash(message: str | None) -> dict[str, Any] | None:
    try:
        data = json.loads(message or "")
    except ValueError:
        return None
    crash = data.get("crash") if isinstance(data, dict) else None
    return crash if isinstance(crash, dict) else None


def describe_crash_report(crash: dict[str, Any]) -> str:
    """"rank 3: RuntimeError: expected ... (trainer.py:212)"."""
    rank = crash.get("rank")
    text = str(crash.get("message") or crash.get("kind") or "crashed")
    where = crash.get("location")
    line = f"rank {rank}: {text}" if isinstance(rank, int) else text
    suffix = f" ({where})" if isinstance(where, str) and where else ""
    return shorten(line, MAX_CAUSE_CHARS - len(suffix)) + suffix


def describe_log_tail(tail: str) -> str | None:
    """The last exception a log's tail shows (a traceback's last line), else its last line."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for line in reversed(lines):
        match = _EXCEPTION_LINE.match(line)
        if match and not match["type"].endswith(_WRAPPERS):
            return shorten(line)
    return shorten(lines[-1]) if lines else None


def describe_oom_kill(memory_limit: str | None) -> str:
    limit = f" ({memory_limit})" if memory_limit else ""
    return f"{REASON_OOM_KILLED}: the pod exceeded resources.memory{limit}"


def crash_cause(
    message: str | None, reason: str | None = None, memory_limit: str | None = None
) -> str | None:
    """Why the container failed, from its termination `message` and `reason`; None when
    neither says more than the exit code."""
    parts: list[str] = []
    if reason == REASON_OOM_KILLED:
        parts.append(describe_oom_kill(memory_limit))
    crash = _crash(message)
    if crash is not None:
        parts.append(describe_crash_report(crash))
    elif message and not message.lstrip().startswith("{"):
        # Not a report (a final report or a configuration error is JSON): a log's tail.
        cause = describe_log_tail(message)
        if cause:
            parts.append(cause)
    return "; ".join(parts) or None
