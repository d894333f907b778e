"""Durable file operations the export (`export.py`), the data cache (`data/cache.py`), its
shared copy (`data/shared.py`) and `location.Location.write_atomic` share: a file or directory
is fsynced before it is renamed into place, so a crash or a power loss never leaves a name
pointing at bytes that were not written."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete a file or a directory tree; absent is fine. A symlink is removed, never followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
