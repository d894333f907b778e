"""A stuck rank ends even when its stuck main thread holds a lock its exit path needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The stuck main thread holds the root handler's lock (as it would, blocked writing a log
# line to a full stderr pipe); the beat thread's exit must not wait on it.
CHILD = """
import logging, sys, threading, time
from finetune_trainer import startup_barrier
from finetune_trainer.startup_beats import StartupStalledError
handler = logging.StreamHandler(sys.stderr)
logging.getLogger().addHandler(handler)
startup_barrier.STUCK_EXIT_GRACE_S = 0.5
handler.acquire()
error = StartupStalledError("rank 1 made no progress in phase data")
threading.Thread(target=startup_barrier.end_stuck_rank, args=(error,), daemon=True).start()
time.sleep(60)
"""


def test_a_stuck_rank_exits_though_its_main_thread_holds_the_logging_lock(
    tmp_path: Path,
) -> None:
    error_file = tmp_path / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, timeout=50,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 45  # not the child's 60 s sleep
    # The error file was written before anything that could block.
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message.startswith("StartupStalledError: rank 1 made no progress"), message
