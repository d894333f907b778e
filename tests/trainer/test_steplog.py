"""The JSON step log stays one object per line while other threads log to the same file
(with `print` in place of `write_json_line` the stress test fails within a few hundred lines)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from finetune_trainer.steplog import write_json_line
from tests.conftest import json_lines

# Stdout and stderr into one file, Python unbuffered: a container's log as the trainer image
# writes it. Two threads log (stderr) while the main thread writes step lines (stdout).
_STRESS = textwrap.dedent(
    """
    import logging, sys, threading
    from finetune_trainer.steplog import write_json_line
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
    stop = threading.Event()
    def chatter(name):
        log = logging.getLogger(name)
        while not stop.is_set():
            log.info("checkpoint step committed in 0.01 s by %s", name)
    threads = [threading.Thread(target=chatter, args=(f"t{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for step in range(1, N + 1):
        write_json_line({"step": step, "loss": 1.5, "tokens_per_second": 123.4})
    stop.set()
    for t in threads:
        t.join()
    """
)


def test_step_lines_stay_whole_under_concurrent_logging(tmp_path: Path) -> None:
    n = 3000
    log = tmp_path / "pod.log"
    with log.open("wb") as out:
        proc = subprocess.run(
            [sys.executable, "-u", "-c", _STRESS.replace("N + 1", f"{n} + 1")],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=120,
            check=False,
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-2000:]
    steps = [r["step"] for r in json_lines(text) if "step" in r]
    assert steps == list(range(1, n + 1))
    others = [ln for ln in text.splitlines() if not ln.startswith("{")]
    assert others, "the logging threads wrote nothing: the test raced nothing"
    assert all(ln.startswith(("t0 ", "t1 ")) for ln in others), [
        ln for ln in others if not ln.startswith(("t0 ", "t1 "))
    ][:3]


def test_a_stream_without_a_file_gets_the_whole_line(capsys: pytest.CaptureFixture[str]) -> None:
    write_json_line({"step": 7, "loss": 0.5})
    assert capsys.readouterr().out == '{"step": 7, "loss": 0.5}\n'
