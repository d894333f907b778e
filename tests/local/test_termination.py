"""The local kubelet's termination message, against the real kubelet's rules
(pkg/kubelet/kuberuntime getTerminationMessage / readLastStringFromContainerLogs): the file's
last 4096 bytes; FallbackToLogsOnError only for a non-zero exit and a zero-byte file, then the
log's last 80 lines, at most 2048 bytes, of this container instance only."""

from __future__ import annotations

import pathlib

import pytest

from finetune_local.termination import (
    FALLBACK_TO_LOGS,
    begin_instance,
    log_tail,
    read_message,
)

FALLBACK = {"terminationMessagePolicy": FALLBACK_TO_LOGS}


@pytest.fixture
def files(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    message, log = tmp_path / "termination-log", tmp_path / "c.log"
    message.write_bytes(b"")
    log.write_bytes(b"starting\nTraceback (most recent call last):\nImportError: no module x\n")
    return message, log


@pytest.mark.parametrize(
    ("policy", "content", "code", "expected"),
    [
        ({}, b'{"step": 7}', 0, '{"step": 7}'),
        (FALLBACK, b'{"step": 7}', 1, '{"step": 7}'),  # a message beats the log
        (FALLBACK, b"", 1, "starting\nTraceback (most recent call last):\nImportError: no module x\n"),
        (FALLBACK, b"", 0, ""),  # only on failure
        (FALLBACK, b"\n", 1, "\n"),  # whitespace is a message: the file is not empty
        ({}, b"", 1, ""),  # policy File: never the log
        ({"terminationMessagePolicy": "File"}, b"", 2, ""),
    ],
    ids=["file", "file-beats-log", "fallback", "success-no-fallback", "whitespace-is-a-message",
         "default-policy", "file-policy"],
)  # fmt: skip
def test_read_message(
    files: tuple[pathlib.Path, pathlib.Path],
    policy: dict[str, str],
    content: bytes,
    code: int,
    expected: str,
) -> None:
    message, log = files
    message.write_bytes(content)
    assert read_message(policy, message, log, code) == expected


def test_a_long_message_keeps_its_last_4096_bytes(files: tuple[pathlib.Path, pathlib.Path]) -> None:
    message, log = files
    message.write_bytes(b"a" * 5000 + b"END")
    got = read_message({}, message, log, 1)
    assert len(got) == 4096 and got.endswith("aEND")


def test_a_missing_file_counts_as_empty(files: tuple[pathlib.Path, pathlib.Path]) -> None:
    message, log = files
    message.unlink()
    assert read_message(FALLBACK, message, log, 1).endswith("ImportError: no module x\n")
    assert read_message({}, message, log, 1) == ""


@pytest.mark.parametrize(
    ("lines", "expected_lines"),
    [(200, 80), (30, 30)],
    ids=["80-lines-cap", "short-log"],
)
def test_log_tail_keeps_the_last_80_lines(
    tmp_path: pathlib.Path, lines: int, expected_lines: int
) -> None:
    log = tmp_path / "c.log"
    log.write_bytes(b"".join(f"{i}\n".encode() for i in range(lines)))
    tail = log_tail(log)
    assert tail.splitlines() == [str(i) for i in range(lines - expected_lines, lines)]


def test_log_tail_keeps_the_last_2048_bytes_of_them(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "c.log"
    log.write_bytes(
        b"".join(f"{i:03d}".encode() + b"x" * 96 + b"\n" for i in range(50))
    )  # 100 B a line
    tail = log_tail(log)
    assert len(tail.encode()) == 2048 and tail.endswith("049" + "x" * 96 + "\n")
    assert tail.startswith("x" * 47 + "\n030")  # cut inside line 029, as a byte ring buffer cuts
    log.write_bytes(b"no newline at the end")
    assert log_tail(log) == "no newline at the end"


def test_a_restarted_container_has_its_own_file_and_log(
    files: tuple[pathlib.Path, pathlib.Path],
) -> None:
    message, log = files
    message.write_text('{"stopReason": "Signal"}')
    start = begin_instance(message, log)  # the kubelet restarts the container
    assert message.read_bytes() == b""
    assert read_message(FALLBACK, message, log, 1, start) == ""  # nothing of the earlier one
    with log.open("ab") as fh:
        fh.write(b"second instance died\n")
    assert read_message(FALLBACK, message, log, 1, start) == "second instance died\n"
