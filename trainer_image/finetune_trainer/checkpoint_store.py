"""The checkpoint directory layout, without torch.distributed: discovery, commit markers,
validation and retention. `<root>/step-00000120/` holds one DCP checkpoint; a `COMMITTED`
file inside it (JSON metadata) says every rank finished writing it."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_operator.api.constants import (
    CHECKPOINT_COMMITTED_MARKER,
    CHECKPOINT_STEP_PREFIX,
    checkpoint_dir_name,
)
from finetune_trainer.paths import resolve_dir

_STEP_DIR = re.compile(re.escape(CHECKPOINT_STEP_PREFIX) + r"(\d{8,})$")
DCP_METADATA_FILE = ".metadata"


class CorruptCheckpointError(Exception):
    """A committed checkpoint that cannot be read back."""


@dataclass(frozen=True)
class CheckpointDir:
    step: int
    path: Path
    committed: bool


def resolve_root(uri: str, cwd: Path | None = None) -> Path:
    """A checkpoint URI as a directory (see `resolve_dir`)."""
    return resolve_dir(uri, "checkpoint.uri", cwd)


def step_dir(root: Path, step: int) -> Path:
    return root / checkpoint_dir_name(step)


def list_checkpoints(root: Path) -> list[CheckpointDir]:
    """Every `step-*` directory under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir():
            committed = (child / CHECKPOINT_COMMITTED_MARKER).is_file()
            found.append(CheckpointDir(int(m.group(1)), child, committed))
    return sorted(found, key=lambda c: c.step)


def committed_newest_first(root: Path) -> list[CheckpointDir]:
    return [c for c in reversed(list_checkpoints(root)) if c.committed]


def write_marker(path: Path, meta: dict[str, Any]) -> None:
    """Write `COMMITTED` atomically (temp file + rename), so a reader never sees half of it."""
    tmp = path / f".{CHECKPOINT_COMMITTED_MARKER}.tmp"
    tmp.write_text(json.dumps(meta, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path / CHECKPOINT_COMMITTED_MARKER)


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / CHECKPOINT_COMMITTED_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def validate(path: Path) -> None:
    """Cheap structural check before loading: the DCP metadata unpickles and every byte range
    it points at exists. Catches truncated, missing and garbled files without touching the
    model; it cannot see flipped bits inside a tensor (DCP stores no checksums)."""
    try:
        with (path / DCP_METADATA_FILE).open("rb") as f:
            metadata = pickle.load(f)
        storage = metadata.storage_data
        ends: dict[str, int] = {}
        for info in storage.values():
            end = int(info.offset) + int(info.length)
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
    except Exception as e:
        raise CorruptCheckpointError(f"{path}: unreadable DCP metadata ({e!r})") from e
    for rel, end in ends.items():
        file = path / rel
        size = file.stat().st_size if file.is_file() else -1
        if size < end:
            raise CorruptCheckpointError(f"{path}: {rel} has {size} bytes, metadata needs {end}")


def remove_partial(root: Path) -> list[Path]:
    """Delete every uncommitted step directory (leftovers of saves that never finished).
    Only safe while no save is in flight: at start, before anything is written."""
    removed = []
    for c in list_checkpoints(root):
        if not c.committed:
            shutil.rmtree(c.path, ignore_errors=True)
            removed.append(c.path)
    return removed


def purge(root: Path, keep: int, *, below_step: int | None = None) -> list[Path]:
    """Keep the newest `keep` committed checkpoints; delete older committed ones and
    uncommitted ones older than `below_step` (the step just committed)."""
    checkpoints = list_checkpoints(root)
    committed = [c for c in checkpoints if c.committed]
    doomed = committed[: max(0, len(committed) - keep)]
    if below_step is not None:
        doomed += [c for c in checkpoints if not c.committed and c.step < below_step]
    for c in doomed:
        # The marker goes first: a half-deleted directory must never look committed.
        (c.path / CHECKPOINT_COMMITTED_MARKER).unlink(missing_ok=True)
        shutil.rmtree(c.path, ignore_errors=True)
    return [c.path for c in doomed]
