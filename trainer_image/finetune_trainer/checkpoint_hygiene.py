"""The start-up cleanup's deferred deletes (see `checkpoint_store.cleanup_plan`): how long
they wait, and the delete itself."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from finetune_trainer import checkpoint_store as store
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.location import Location

# Uncommitted steps newer than every committed one are left at start (a lagging NFS view may
# hide their marker: checkpoint_store.cleanup_plan) and deleted by the first purge this long
# after that look, if their marker does not open then: twice NFS's longest default attribute
# cache lifetime (acdirmax 60 s), after which the view of the directory has been revalidated.
# Only where a view can lag (`default_grace`): on a local filesystem they go with the first
# purge.
CLEANUP_GRACE_ENV = "FT_CHECKPOINT_CLEANUP_GRACE_SECONDS"
CLEANUP_GRACE_SECONDS = 120.0


# A local filesystem (a node's disk, a block-device PersistentVolume) is one node's and never
# lags. Every other keeps the grace: one whose clients answer lookups and attributes from a
# cache the server does not invalidate (NFS's acdirmax/acregmax, SMB's actimeo, FUSE's
# entry/attr timeouts, Lustre's and Gluster's client caches) may hide a marker another node
# just wrote, and so may an object store or a path whose filesystem is not known.
LOCAL_FILESYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "tmpfs", "overlay", "f2fs", "ramfs"}
)


def _unescape(field: str) -> str:
    """/proc/mounts writes a space, tab, newline or backslash in a path as an octal escape."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: str, mounts: str) -> str | None:
    """Pure: the type of the filesystem holding absolute `path`, from the text of
    /proc/self/mounts (the deepest mount point containing it; the last mount of a point wins,
    as a later mount hides an earlier one). None when nothing contains it."""
    path = posixpath.normpath(path)
    best: tuple[int, str] | None = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point, fstype = posixpath.normpath(_unescape(fields[1])), fields[2]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), fstype)
    return best[1] if best else None


def default_grace(root: Location, mounts: str | None) -> float:
    """Pure: how long a deferred delete waits where nothing overrides it: none on a local
    filesystem (its view cannot lag), CLEANUP_GRACE_SECONDS on a caching network filesystem,
    an object store, or a filesystem not known."""
    if not root.is_local or mounts is None:
        return CLEANUP_GRACE_SECONDS
    fstype = filesystem_type(str(root.local_path), mounts)
    if fstype in LOCAL_FILESYSTEMS:
        return 0.0
    return CLEANUP_GRACE_SECONDS


def read_mounts() -> str | None:
    """This process's mount table, or None where there is none to read (not Linux)."""
    try:
        return Path("/proc/self/mounts").read_text()
    except OSError:
        return None


def cleanup_grace(env: Mapping[str, str], default: float = CLEANUP_GRACE_SECONDS) -> float:
    """CLEANUP_GRACE_ENV (seconds, >= 0), or `default` (`default_grace` of the root);
    anything else is refused by name."""
    raw = env.get(CLEANUP_GRACE_ENV)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise UnsupportedConfigError(
            f"{CLEANUP_GRACE_ENV}={raw!r}: expected a number of seconds, 0 or more"
        )
    return value


def purge_deferred(
    paths: list[Location], guard: Callable[[], None] | None = None
) -> list[Location]:
    """Delete the uncommitted steps the start-up cleanup left whose marker still does not
    open (only while no save is in flight: the caller runs in the commit). `guard` runs
    before each delete and stops them by raising (a writer fenced meanwhile: the folder may
    be a newer incarnation's save of that step, in flight). Returns them."""
    removed = []
    for path in paths:
        if not store.marker_opens(path):
            if guard is not None:
                guard()
            path.remove()
            removed.append(path)
    return removed
