"""Container termination messages, as a kubelet provides them: a file bind-mounted at
`terminationMessagePath` (default /dev/termination-log), new for each container instance,
whose content, after the container exits, becomes `state.terminated.message`.

The kubelet's rules (pkg/kubelet/kuberuntime, `getTerminationMessage` and
`readLastStringFromContainerLogs`), kept exactly:
- it reads the file's *last* 4096 bytes (`tail.ReadAtMost`): a longer message loses its start;
- with `terminationMessagePolicy: FallbackToLogsOnError`, a container that exited non-zero
  and left the file *empty* (zero bytes: whitespace is a message) gets the tail of its own log
  instead: its last 80 lines, of which at most the last 2048 bytes, newlines kept;
- a missing file counts as empty; any other read error becomes the message.
The log is this container instance's only: a restarted container's earlier output is not its.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Mapping
from typing import Any

DEFAULT_PATH = "/dev/termination-log"
FALLBACK_TO_LOGS = "FallbackToLogsOnError"
MAX_MESSAGE_BYTES = 4096  # the kubelet's cap per container
LOG_TAIL_LINES = 80  # FallbackToLogsOnError: at most 80 lines ...
LOG_TAIL_BYTES = 2048  # ... and 2 KiB
_LINE = re.compile(rb"[^\n]*\n|[^\n]+\Z")  # lines split on "\n" only, as the CRI log's are


def termination_mount(container: Mapping[str, Any], file: pathlib.Path) -> dict[str, Any]:
    """The mount for the message file (created empty, so a rerun never reads a stale one)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("")
    target = str(container.get("terminationMessagePath") or DEFAULT_PATH)
    return {"source": str(file), "target": target, "readOnly": False}


def begin_instance(file: pathlib.Path, log: pathlib.Path) -> int:
    """A container instance starts: its message file is new (empty), and its log begins at
    the returned offset of the pod's log file (which the local kubelet appends to)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(b"")
    try:
        return log.stat().st_size
    except FileNotFoundError:
        return 0


def _tail(path: pathlib.Path, size: int, start: int = 0) -> bytes:
    """The last `size` bytes of `path` from offset `start` on."""
    with path.open("rb") as fh:
        end = fh.seek(0, 2)
        fh.seek(max(start, end - size))
        return fh.read()


def log_tail(log: pathlib.Path, start: int = 0) -> str:
    """FallbackToLogsOnError's message: the log's last 80 lines (from byte `start`, where this
    container instance's output begins), at most their last 2048 bytes. Those bytes are the
    file's last 2048 at most, so only they are read, however long the log."""
    try:
        window = _tail(log, LOG_TAIL_BYTES, start)
    except OSError as e:
        return f"Error on reading termination message from logs: {e}"
    lines = _LINE.findall(window)
    return b"".join(lines[-LOG_TAIL_LINES:]).decode(errors="replace")


def read_message(
    container: Mapping[str, Any],
    file: pathlib.Path,
    log: pathlib.Path,
    exit_code: int,
    log_start: int = 0,
) -> str:
    """`state.terminated.message` of a container that exited with `exit_code`."""
    fallback = container.get("terminationMessagePolicy") == FALLBACK_TO_LOGS and exit_code != 0
    try:
        data = _tail(file, MAX_MESSAGE_BYTES)
    except FileNotFoundError:
        data = b""
    except OSError as e:
        return f"Error on reading termination log {file}: {e}"
    if data or not fallback:
        return data.decode(errors="replace")
    return log_tail(log, log_start)
