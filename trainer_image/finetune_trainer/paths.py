"""Checkpoint and output URIs as local directories."""

from __future__ import annotations

from pathlib import Path

from finetune_trainer.errors import UnsupportedConfigError


def resolve_dir(uri: str, field: str, cwd: Path | None = None) -> Path:
    """A path or file:// URI as a directory; relative paths resolve against the working
    directory (a shared volume in a pod). Object stores are refused naming the field."""
    if uri.startswith("file://"):
        uri = uri.removeprefix("file://")
    elif "://" in uri:
        raise UnsupportedConfigError(
            f"{field} {uri!r}: object storage is not implemented yet; use a path on a shared "
            "filesystem (relative paths resolve against the working directory)"
        )
    path = Path(uri)
    return path if path.is_absolute() else (cwd or Path.cwd()) / path
