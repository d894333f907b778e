"""One entry of the tokenized-blocks cache (`cache.py`): its files and their check.

    blocks.bin    the blocks, row-major, `meta.dtype`, shape (rows, seq_len)
    meta.json     written last: format version, key, shape, dtype, samples, xxh3-128 of blocks.bin
    verified.json the pod's own entry only: what blocks.bin was when its checksum last matched

`EntryWriter` streams the blocks into a new entry's directory within a byte budget, hashing
as it goes, and writes the meta last; `open_entry` maps an entry read-only only if its meta
names the key asked for and its bytes match the size and checksum written, so a truncated or
corrupted entry (a local one, or one copied from the job's shared copy, `shared.py`) is never
read.

**Verified once per pod.** Hashing reads every byte (0.1-0.2 s per GB, per rank, per start),
and a torchelastic restart re-opens an entry its pod verified seconds earlier. After a full
verification of the pod's own entry (`remember`), `verified.json` records the file's identity
then (size, mtime and ctime in ns, inode and device), the checksum it matched and the node's
boot; a later open whose file still has exactly that identity, under the same meta and boot,
skips the read. Any write to the file changes its ctime (which, unlike the mtime, no one can
set back), a file put in its place has another inode, a reboot (a crash may lose what was not
written back) another boot id: each means a full verification again, and damage means a
rebuild, as before. Not covered: bits rotting on the disk under an unchanged inode, which
the per-start hash would have caught on the next restart (the stamp's trade). The shared copy
never gets a stamp: every pod verifies what it copies from there.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from finetune_trainer.files import write_synced

log = logging.getLogger(__name__)

# Bump whenever the blocks a given input yields change (tokenizing, packing, file layout).
CACHE_FORMAT_VERSION = 1
BLOCKS_FILE, META_FILE, STAMP_FILE = "blocks.bin", "meta.json", "verified.json"
_HASH_CHUNK = 64 << 20


class CacheFullError(Exception):
    """The blocks would not fit the cache's limit or the volume's free space."""


@dataclass(frozen=True)
class Entry:
    blocks: np.memmap[Any, np.dtype[Any]]
    samples: int


def _checksum(blocks: np.ndarray[Any, np.dtype[Any]]) -> str:
    h = xxhash.xxh3_128()
    flat = blocks.reshape(-1)
    step = max(1, _HASH_CHUNK // max(1, flat.itemsize))
    for start in range(0, flat.size, step):
        h.update(np.ascontiguousarray(flat[start : start + step]).data)
    return h.hexdigest()


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def stamp_for(st: os.stat_result, checksum: str, boot: str | None) -> dict[str, Any]:
    """Pure: what a verification of a file with status `st` against `checksum` vouches for."""
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
        "xxh3_128": checksum,
        "boot": boot,
    }


def stamped(
    recorded: bytes | None,
    written_ns: int,
    st: os.stat_result,
    checksum: str,
    boot: str | None,
) -> bool:
    """Pure: whether the stamp `recorded` (its file last written at `written_ns`) vouches for
    the file as it is now (`st`), under the meta's `checksum`; an unreadable stamp, or none,
    does not. Nor does one written in the same clock tick as the file's last change (file
    times are coarse, a few ms): a write to the file later in that tick would leave its
    ctime as stamped (git's "racily clean" index entries, the same rule)."""
    if recorded is None or boot is None:
        return False
    try:
        vouched = json.loads(recorded) == stamp_for(st, checksum, boot)
    except ValueError:
        return False
    return bool(vouched) and written_ns > st.st_ctime_ns


def _read_stamp(path: Path) -> tuple[bytes | None, int]:
    try:
        with open(path / STAMP_FILE, "rb") as f:
            return f.read(), os.fstat(f.fileno()).st_mtime_ns
    except OSError:
        return None, 0


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file's bytes may have (its atime does not)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remember(path: Path, st: os.stat_result, checksum: str, boot: str | None) -> None:
    """Write the stamp (through a temporary name: a torn stamp would only cost a verification,
    but there is no reason to leave one). Not fsynced: lost in a crash, it costs one read."""
    tmp = path / f".{STAMP_FILE}.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(stamp_for(st, checksum, boot)))
        os.replace(tmp, path / STAMP_FILE)
    except OSError as e:
        log.warning("data cache entry %s: could not record its verification (%r)", path, e)


def open_entry(path: Path, key: str, *, remember: bool = False) -> Entry | None:
    """The entry's blocks, mapped read-only, or None (logged) unless it is complete and
    intact: its meta names this key, the file has exactly the size the shape says, and its
    bytes hash to the checksum written when it was built. `remember`: the pod's own entry,
    whose verification is stamped and skipped while the file is unchanged (module
    docstring)."""
    try:
        meta = json.loads((path / META_FILE).read_text())
        if meta.get("version") != CACHE_FORMAT_VERSION or meta.get("key") != key:
            raise ValueError("built for other inputs")
        dtype, rows, seq_len = np.dtype(meta["dtype"]), int(meta["rows"]), int(meta["seq_len"])
        st = (path / BLOCKS_FILE).stat()
        size = st.st_size
        if size != rows * seq_len * dtype.itemsize or rows < 1:
            raise ValueError(f"{size} bytes where {rows} x {seq_len} {dtype} blocks were written")
        blocks: np.memmap[Any, np.dtype[Any]] = np.memmap(
            path / BLOCKS_FILE, dtype=dtype, mode="r", shape=(rows, seq_len)
        )
        checksum, boot = str(meta["xxh3_128"]), boot_id()
        if not (remember and stamped(*_read_stamp(path), st, checksum, boot)):
            if _checksum(blocks) != checksum:
                raise ValueError("checksum mismatch")
            # Stamped only if the file did not change while it was read. Not the whole stat:
            # reading it may move its atime (relatime), which says nothing of its bytes.
            if remember and _identity((path / BLOCKS_FILE).stat()) == _identity(st):
                _remember(path, st, checksum, boot)
        return Entry(blocks=blocks, samples=int(meta["samples"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("data cache entry %s unusable (%s): rebuilding it", path, e)
        return None


class EntryWriter:
    """Appends blocks to a new entry's file, within a byte budget, hashing as it goes."""

    def __init__(self, directory: Path, budget: int | None) -> None:
        self.directory, self.budget = directory, budget
        self.file = open(directory / BLOCKS_FILE, "wb")  # noqa: SIM115 - closed in finish()
        self.hash = xxhash.xxh3_128()
        self.rows = self.bytes = 0

    def write(self, blocks: np.ndarray[Any, np.dtype[Any]]) -> None:
        data = np.ascontiguousarray(blocks)
        if self.budget is not None and self.bytes + data.nbytes > self.budget:
            raise CacheFullError(f"over {self.budget} bytes")
        self.file.write(data.data)
        self.hash.update(data.data)
        self.rows += len(data)
        self.bytes += data.nbytes

    def finish(self, *, key: str, dtype: np.dtype[Any], seq_len: int, samples: int) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        meta = {
            "version": CACHE_FORMAT_VERSION,
            "key": key,
            "dtype": dtype.str,
            "rows": self.rows,
            "seq_len": seq_len,
            "samples": samples,
            "xxh3_128": self.hash.hexdigest(),
        }
        write_synced(self.directory / META_FILE, json.dumps(meta).encode())

    def abort(self) -> None:
        self.file.close()
