"""Rank 0's JSON step log: one JSON object per line on stdout, each line a single write.

Why not `print`: the trainer image runs Python unbuffered (`PYTHONUNBUFFERED=1`, so logs are
not lost on a crash), and there `print(obj)` is two writes: the text, then the newline. A
container's stdout and stderr are one log file, so a log record written to stderr by another
thread (the checkpoint commit thread, the metrics server) between those two writes lands on the
step's line, and a JSON-lines reader fails on it (seen about once in 1,500 steps). Here the
whole line, newline included, goes down in one `os.write` under a lock: a record on stderr
lands before or after it, never inside.
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
from collections.abc import Mapping
from typing import TextIO

_lock = threading.Lock()


def write_json_line(record: Mapping[str, object], stream: TextIO | None = None) -> None:
    """Write `record` as one JSON line to `stream` (stdout by default) in one write."""
    out = stream if stream is not None else sys.stdout
    line = json.dumps(record) + "\n"
    with _lock:
        out.flush()  # whatever was printed before stays before
        try:
            fd = out.fileno()
        except (AttributeError, OSError, io.UnsupportedOperation):
            fd = -1  # a stream with no file behind it (a test's capture): one write there
        if fd < 0:
            out.write(line)
            out.flush()
            return
        data = memoryview(line.encode())
        while data:  # a file or a pipe takes a line whole; loop only for a signal's short write
            data = data[os.write(fd, data) :]
