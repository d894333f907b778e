"""A refused configuration stops the pod's torchrun at once: no restart could run it. Under
a real torchrun: tests/trainer/test_ownership.py (a checkpoint root another job owns)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from finetune_trainer import refusal


def test_a_trainer_not_run_by_the_launcher_signals_nobody(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(refusal.ENV, raising=False)
    assert not refusal.refuse("no launcher")
    # Armed by a process that is not this worker's parent (a wrapper passed it on): untouched.
    marker = tmp_path / "message"
    monkeypatch.setenv(refusal.ENV, f"{os.getpid()}:{marker}")
    assert os.getppid() != os.getpid()
    assert not refusal.refuse("not my agent")
    assert not marker.exists() and refusal.refused(marker) is None


def test_arm_names_a_fresh_file_and_disarm_removes_it() -> None:
    path = refusal.arm()
    assert path is not None
    try:
        assert os.environ[refusal.ENV] == f"{os.getpid()}:{path}"
        assert path.parent.is_dir() and refusal.refused(path) is None
    finally:
        refusal.disarm(path)
    assert refusal.ENV not in os.environ and not path.parent.exists()


def test_no_temporary_directory_means_retries_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(**_: str) -> str:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(refusal.tempfile, "mkdtemp", read_only)
    monkeypatch.delenv(refusal.ENV, raising=False)
    assert refusal.arm() is None and refusal.ENV not in os.environ
    assert refusal.refused(None) is None
