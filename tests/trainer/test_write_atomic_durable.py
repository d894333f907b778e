"""Location.write_atomic on a volume is durable in order: the new content is fsynced before
the rename, and the directory after it. Without the first, a node lost after the rename could
leave the name over an empty file (a COMMITTED marker vouching for nothing); without the
second, the rename itself may not be on disk when the commit is reported and older steps
are purged (the step reads as uncommitted after the crash, and is deleted as a partial save)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from finetune_trainer.location import locate


def test_the_file_then_the_directory_are_fsynced_around_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    marker = locate(str(tmp_path / "step-2"), "test") / "COMMITTED"
    marker.write_atomic(b'{"step": 2}\n')
    assert (tmp_path / "step-2" / "COMMITTED").read_bytes() == b'{"step": 2}\n'
    target = str(tmp_path / "step-2" / "COMMITTED")
    assert [kind for kind, _ in events] == ["fsync", "replace", "fsync"], events
    assert events[0][1].endswith(".COMMITTED.tmp")  # the new content, before the rename
    assert events[1][1] == target
    assert events[2][1] == str(tmp_path / "step-2")  # the rename itself, after it
