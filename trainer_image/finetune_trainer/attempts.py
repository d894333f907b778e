"""torchrun's attempts in this pod, from torchelastic's error files: how many of its restarts
followed a failure of the pod's own (the job's one restart budget counts those,
reconcile/budget.py), not a peer that left, which torch restarts, and counts, alike.

torchelastic's layout (`DefaultLogsSpecs`): `<log dir>/<run id>_<x>/attempt_<k>/<local rank>/
error.json`, one `attempt_<k>` per restart count (a membership restart keeps the count and
rewrites its directory), an error file per rank that raised under `errors.record`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from finetune_trainer.crash import PEER_LOSS_MARKERS

_ATTEMPT = re.compile(r"attempt_(\d+)")


def _error_message(path: Path) -> str:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):  # torchelastic's {"message": {"message": ..., ...}}
        message = message.get("message")
    return str(message or "")


def _own_failure(attempt: Path) -> bool:
    """Whether this pod's worker group failed of its own in `attempt` (one of torchelastic's
    `<log dir>/<run>/attempt_<k>/` directories, `<local rank>/error.json` in it): a rank
    raised something other than a lost peer, or died without an error file (killed). A group
    whose every error is a lost peer failed because another pod failed (counted there) or a
    peer was taken away (a membership change: never counted)."""
    messages = [_error_message(f) for f in attempt.glob("*/error.json")]
    if not messages:
        return True
    return any(not any(m in text for m in PEER_LOSS_MARKERS) for text in messages)


def own_failure_restarts(log_dir: Path) -> int | None:
    """torchrun's restarts in this pod that followed a failure of the pod's own, out of all
    of them (torch also restarts, and counts against --max-restarts, a group whose peer left):
    one per attempt before the last that failed of its own. None: no attempt found."""
    attempts = sorted(
        (int(m[1]), path)
        for path in log_dir.glob("*/attempt_*")
        if path.is_dir() and (m := _ATTEMPT.fullmatch(path.name))
    )
    if not attempts:
        return None
    return sum(1 for _, path in attempts[:-1] if _own_failure(path))


def failure_restarts_so_far(error_file: str | None) -> int:
    """In a running worker (its `TORCHELASTIC_ERROR_FILE`, `<log dir>/<run>/attempt_<k>/<local
    rank>/error.json`): the restarts so far that followed a failure of this pod's own. The
    current attempt, the last directory, has not failed. 0 outside torchrun."""
    if not error_file:
        return 0
    path = Path(error_file)
    if len(path.parents) < 4 or not _ATTEMPT.fullmatch(path.parents[1].name):
        return 0
    return own_failure_restarts(path.parents[3]) or 0
