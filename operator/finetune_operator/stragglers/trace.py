"""The step trace format (one JSON object per line, one line per rank per step) and its
reader, for `ftjob stragglers`:

    {"step": 120, "rank": 3, "pod": "job-worker-1", "node": "gpu-7", "computeSeconds": 0.41,
     "waitSeconds": 0.02, "restart": 0, "started": 1795430000.12, "checkpoint": false}

`step`, `rank` and `computeSeconds` are required; unknown keys are ignored (room to grow).
`started` (when the trainer process started, unix seconds) tells apart two runs of one rank on
one pod with one restart count: a re-form that only added nodes restarts every process but
keeps the restart count.
A malformed line is a `TraceError` naming the file and line number.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from finetune_operator.stragglers.types import StepRecord


class TraceError(ValueError):
    """A trace that cannot be read: `line` is 1-based, 0 for the file as a whole."""

    def __init__(self, source: str, line: int, reason: str) -> None:
        self.source, self.line, self.reason = source, line, reason
        super().__init__(f"{source}:{line}: {reason}" if line else f"{source}: {reason}")


def _int(obj: dict[str, Any], key: str, default: int | None, minimum: int) -> int:
    value = obj.get(key, default)
    if value is None:
        raise ValueError(f"missing required key {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{key!r} must be >= {minimum}, got {value}")
    return value


def _seconds(obj: dict[str, Any], key: str, default: float | None) -> float:
    value = obj.get(key, default)
    if value is None:
        raise ValueError(f"missing required key {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key!r} must be a number of seconds, got {value!r}")
    if value < 0:
        raise ValueError(f"{key!r} must be >= 0, got {value}")
    return float(value)


def _optional_seconds(obj: dict[str, Any], key: str) -> float | None:
    return None if obj.get(key) is None else _seconds(obj, key, None)


def _text(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {value!r}")
    return value


def parse_record(text: str) -> StepRecord:
    """One trace line; `ValueError` with the reason if it is not one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    checkpoint = obj.get("checkpoint", False)
    if not isinstance(checkpoint, bool):
        raise ValueError(f"'checkpoint' must be true or false, got {checkpoint!r}")
    return StepRecord(
        step=_int(obj, "step", None, 0),
        rank=_int(obj, "rank", None, 0),
        compute_seconds=_seconds(obj, "computeSeconds", None),
        wait_seconds=_seconds(obj, "waitSeconds", 0.0),
        pod=_text(obj, "pod"),
        node=_text(obj, "node"),
        restart=_int(obj, "restart", 0, 0),
        started=_optional_seconds(obj, "started"),
        checkpoint=checkpoint,
        steps=_int(obj, "steps", 1, 1),
    )


def parse_trace(lines: Iterable[str], source: str) -> list[StepRecord]:
    """All records of one trace; blank lines are skipped."""
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(parse_record(line))
        except ValueError as e:
            raise TraceError(source, n, str(e)) from None
    return out


def trace_files(paths: Sequence[str | Path]) -> list[Path]:
    """The files named, a directory standing for its `*.jsonl` files (e.g. one per rank)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.jsonl"))
            if not found:
                raise TraceError(str(p), 0, "directory holds no *.jsonl trace files")
            out.extend(found)
        elif p.exists():  # a file, or a pipe: `ftjob stragglers <(kubectl exec ...)`
            out.append(p)
        else:
            raise TraceError(str(p), 0, "no such file or directory")
    return out


def read_traces(paths: Sequence[str | Path]) -> list[StepRecord]:
    """Every record of every trace file (the thin I/O shell around `parse_trace`)."""
    records: list[StepRecord] = []
    for path in trace_files(paths):
        try:
            with path.open(encoding="utf-8") as fh:
                records.extend(parse_trace(fh, str(path)))
        except UnicodeDecodeError as e:
            raise TraceError(str(path), 0, f"not UTF-8 text ({e.reason})") from None
        except OSError as e:
            raise TraceError(str(path), 0, e.strerror or str(e)) from None
    return records


def record_to_json(r: StepRecord) -> dict[str, Any]:
    """A record as a trace line's object (what the trainer writes)."""
    out: dict[str, Any] = {
        "step": r.step,
        "rank": r.rank,
        "pod": r.pod,
        "node": r.node,
        "computeSeconds": r.compute_seconds,
        "waitSeconds": r.wait_seconds,
        "restart": r.restart,
        "checkpoint": r.checkpoint,
    }
    if r.steps != 1:
        out["steps"] = r.steps
    if r.started is not None:
        out["started"] = r.started
    return out
