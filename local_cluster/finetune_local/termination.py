"""Container termination messages, as a kubelet provides them: a file bind-mounted at
`terminationMessagePath` (default /dev/termination-log) whose content, after the container
exits, becomes `state.terminated.message`; with `terminationMessagePolicy:
FallbackToLogsOnError` an empty file on a failure falls back to the log's tail."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

DEFAULT_PATH = "/dev/termination-log"
MAX_MESSAGE_BYTES = 4096  # the kubelet's cap per container
LOG_TAIL_LINES = 80  # FallbackToLogsOnError: at most 80 lines ...
LOG_TAIL_BYTES = 2048  # ... and 2 KiB


def termination_mount(container: Mapping[str, Any], file: pathlib.Path) -> dict[str, Any]:
    """The mount for the message file (created empty, so a rerun never reads a stale one)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("")
    target = str(container.get("terminationMessagePath") or DEFAULT_PATH)
    return {"source": str(file), "target": target, "readOnly": False}


def read_message(
    container: Mapping[str, Any], file: pathlib.Path, log: pathlib.Path, exit_code: int
) -> str:
    try:
        message = file.read_bytes()[:MAX_MESSAGE_BYTES].decode(errors="replace")
    except OSError:
        message = ""
    fallback = container.get("terminationMessagePolicy") == "FallbackToLogsOnError"
    if message.strip() or not fallback or exit_code == 0:
        return message
    try:
        lines = log.read_bytes().decode(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        return ""
    return "\n".join(lines).encode()[-LOG_TAIL_BYTES:].decode(errors="replace")
