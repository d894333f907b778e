"""The final report a worker leaves in its container termination log.

Kubernetes copies `terminationMessagePath` (default /dev/termination-log) into the pod's
`state.terminated.message` when the container exits; the operator reads the final step, loss
and checkpoint from there, since the metrics endpoint is gone by then.
Keys: step, rank, loss?, checkpointStep?, checkpointFailedStep? (a failed save newer than
checkpointStep), output?, resumedFromStep?, skippedCheckpoints? (committed steps found unusable
at start), stopReason? ("Signal": the trainer stopped because it was told to, e.g. its pod is
being preempted; the operator does not count that as a failure), error? (a configuration error,
`UnsupportedConfigError`: the operator fails the job with it instead of restarting pods that
would refuse again), crash? (a failed worker group's root cause, written by the launcher:
finetune_trainer/crash.py), restarts? (how often torchrun restarted the group after a failure of
the pod's own before the pod ended another way: stopped by a signal, or the rendezvous shut
down, with rendezvousClosed: true; written by the launcher, never with a crash, which carries
its own). Readers ignore keys they do not know."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import MutableMapping, MutableSequence, Sequence
from pathlib import Path
from typing import Any

from finetune_trainer.crash import fit_report

log = logging.getLogger(__name__)

TERMINATION_LOG_ENV = "FT_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
MAX_BYTES = 4096  # the kubelet keeps at most this much, in bytes, and cuts the rest
ELLIPSIS = "…"


def _size(data: Any) -> int:
    return len(json.dumps(data).encode())


def _strings(data: Any) -> list[tuple[Any, Any]]:
    """(container, key) of every string in a JSON document's dicts and lists."""
    found: list[tuple[Any, Any]] = []
    items = data.items() if isinstance(data, MutableMapping) else enumerate(data)
    for key, value in items:
        if isinstance(value, str):
            found.append((data, key))
        elif isinstance(value, MutableMapping | MutableSequence):
            found.extend(_strings(value))
    return found


def fit_json(report: dict[str, Any], limit: int = MAX_BYTES) -> str:
    """`report` as JSON of at most `limit` bytes (UTF-8), valid whatever its strings' lengths:
    the kubelet cuts a longer message mid-token, and the operator then reads nothing at all.
    The longest string loses its end first (marked "…"), then the next longest; keys, numbers
    and lists stay, so a reader still finds every field. Bytes, not characters: a non-ASCII
    character is 6 or 12 bytes as a JSON escape."""
    data = json.loads(json.dumps(report))  # a deep copy, and tuples made lists
    while _size(data) > limit:
        strings = [(c, k) for c, k in _strings(data) if c[k] not in ("", ELLIPSIS)]
        if not strings:
            break  # nothing left to shorten: numbers and keys alone over the limit
        container, key = max(strings, key=lambda ck: _size(ck[0][ck[1]]))
        text: str = container[key]
        # The longest prefix that fits (escapes make bytes per character vary); none: "…".
        low, high = 0, len(text) - 1
        while low < high:
            mid = (low + high + 1) // 2
            container[key] = text[:mid] + ELLIPSIS
            low, high = (mid, high) if _size(data) <= limit else (low, mid - 1)
        container[key] = text[:low] + ELLIPSIS
    return json.dumps(data)


def write_final_report(
    *,
    step: int,
    loss: float | None,
    checkpoint_step: int,
    rank: int,
    checkpoint_failed_step: int = 0,
    path: str | None = None,
    output: str | None = None,
    resumed_from_step: int = 0,
    skipped: list[int] | None = None,
    stop_reason: str | None = None,
) -> bool:
    """Write the report if the termination log exists (it does in a pod); never raises.
    `output`: where the trained model was exported (only the rank that wrote it says so)."""
    report: dict[str, float | int | str | list[int]] = {"step": step, "rank": rank}
    if loss is not None:
        report["loss"] = loss
    if checkpoint_step > 0:
        report["checkpointStep"] = checkpoint_step
    if checkpoint_failed_step > checkpoint_step:
        report["checkpointFailedStep"] = checkpoint_failed_step
    if output:
        report["output"] = output
    if resumed_from_step > 0:
        report["resumedFromStep"] = resumed_from_step
    if skipped:
        report["skippedCheckpoints"] = skipped[:32]
    if stop_reason:
        report["stopReason"] = stop_reason
    return _write_report(report, path)


def write_error_report(message: str, *, rank: int, path: str | None = None) -> bool:
    """Leave a configuration error where the operator reads it; never raises."""
    # Shorten the message, not the JSON: the operator must still be able to parse it.
    return _write_report({"rank": rank, "error": message}, path)


def _write_report(report: dict[str, Any], path: str | None) -> bool:
    """Write `report` (fitted to the size limit) if the termination log exists (it does in a
    pod); never raises."""
    target = Path(path or os.environ.get(TERMINATION_LOG_ENV, DEFAULT_TERMINATION_LOG))
    if not target.exists():
        return False
    try:
        target.write_text(fit_json(report))
    except OSError as e:
        log.warning("could not write the termination report to %s: %s", target, e)
        return False
    return True


def write_crash_report(report: dict[str, Any], path: str | None = None) -> bool:
    """Add a crash report (crash.crash_report) to what the log holds; never raises. A final
    report a trainer left stays beside it (its step and checkpoint are still true), within
    MAX_BYTES; a configuration `error` stays alone: it is the more specific report, and the
    operator fails the job on it instead of restarting."""
    target = Path(path or os.environ.get(TERMINATION_LOG_ENV, DEFAULT_TERMINATION_LOG))
    if not target.exists():
        return False
    try:
        existing = _read_report(target)
        if "error" in existing:
            return False
        existing.pop("crash", None)
        # {**a, **b} as JSON is len(a) + len(b) bytes (", " replaces "}{"): b gets the rest.
        room = MAX_BYTES - (len(json.dumps(existing).encode()) if existing else 0)
        text = json.dumps({**existing, **fit_report(report, limit=room)})
        if len(text.encode()) > MAX_BYTES:  # no room beside it: the crash alone, still valid JSON
            text = json.dumps(fit_report(report))
        # fit_report cuts the traceback and the message; any other long string (a report
        # built elsewhere) is cut here, so what is written always parses.
        target.write_text(fit_json(json.loads(text)))
    except OSError as e:
        log.warning("could not write the crash report to %s: %s", target, e)
        return False
    return True


def write_restarts(
    rounds: Sequence[str], *, rendezvous_closed: bool = False, path: str | None = None
) -> bool:
    """Add the pod's own-failure restarts to what the log holds, when the pod ends without a
    crash report (reconcile/budget.py: the operator counts them however the pod ended); never
    raises. A crash report or a configuration error already there is left alone."""
    target = Path(path or os.environ.get(TERMINATION_LOG_ENV, DEFAULT_TERMINATION_LOG))
    if not target.exists():
        return False
    try:
        report = _read_report(target)
        if "error" in report or "crash" in report:
            return False
        report["restarts"] = len(rounds)
        report["rounds"] = list(rounds)
        if rendezvous_closed:
            report["rendezvousClosed"] = True
        target.write_text(fit_json(report))  # a final report near the limit loses string tails
    except OSError as e:
        log.warning("could not write the restarts to %s: %s", target, e)
        return False
    return True


def _read_report(target: Path) -> dict[str, Any]:
    try:
        data = json.loads(target.read_text() or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def clear_final_report(path: str | None = None) -> None:
    """Empty the termination log at start: torchrun restarts trainers inside one container,
    and a report left by an earlier trainer (say, one stopped by a signal) must never speak
    for a later one that crashed."""
    target = Path(path or os.environ.get(TERMINATION_LOG_ENV, DEFAULT_TERMINATION_LOG))
    if target.exists():
        try:
            target.write_text("")
        except OSError as e:
            log.warning("could not clear the termination report %s: %s", target, e)
