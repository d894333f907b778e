"""A per-pod cache of the tokenized, packed training blocks, reused across restarts.

Without it every rank of every pod tokenizes the whole corpus on every start: minutes for a
GB-scale corpus, times the ranks of a node, on every elastic restart. With it the first rank
of a pod to get there builds the blocks once (streamed: a batch of records at a time), the
other local ranks wait on the entry's file lock, and all of them map the same file read-only
(`numpy.memmap`: one copy in the page cache shared by the 8 ranks of a node, nothing parsed
on open; the blocks are fixed-width rows, so a flat array needs no format beyond its shape).

Layout under the cache directory (`FT_DATA_CACHE_DIR`, the worker pod's `data-cache`
emptyDir, which survives torchelastic's worker restarts and goes with the pod):

    <key>.lock          flock: one builder at a time; never deleted (see `_evict_others`)
    <key>/blocks.bin    the entry (`cache_entry.py`): the blocks, row-major, shape (rows, seq_len)
    <key>/meta.json     written last: key, shape, dtype, xxh3-128 of blocks.bin
    <key>/verified.json blocks.bin's identity when its checksum last matched: later opens
                        skip the full read while it is unchanged (`cache_entry.py`)
    <key>.tmp-<pid>/    an entry being built; renamed to <key>/ once complete
    <key>.skip          the blocks do not fit the cache's limit: every rank tokenizes itself

The key hashes everything that determines the blocks (`cache_key.py`), so a changed file, a
different tokenizer, sequence length, packing, field or format version is a different entry.
An entry is used only if its meta matches the key and its bytes match the checksum
(`cache_entry.open_entry`; read in full once per pod, then while the file is unchanged): a crash mid-build leaves only a `.tmp-*` directory (removed by
the next builder), and a truncated or corrupted entry is rebuilt, never read.

A pod whose cache is empty (a replacement pod) first copies the entry from the job's shared
copy on its checkpoint storage (`shared.py`), verified the same way, and only builds it if
there is none; the pod that builds an entry publishes it there. The pods of a fresh job,
all empty at once, elect one builder there and the others wait for its entry
(`build_claim.py`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from finetune_trainer.data.build_claim import wait_bound
from finetune_trainer.data.cache_entry import CacheFullError, Entry, EntryWriter, open_entry
from finetune_trainer.files import fsync_dir, remove, write_synced
from finetune_trainer.startup_progress import PROGRESS, phase

if TYPE_CHECKING:
    from finetune_trainer.data.shared import SharedCache

log = logging.getLogger(__name__)

PUBLISH_SLOW_BYTES_PER_S = 1e7


@dataclass(frozen=True)
class CacheSettings:
    """Where entries live and how many bytes they may take in all (the volume's sizeLimit
    less a margin: a pod whose emptyDir outgrows its sizeLimit is evicted); `shared`: the
    job's copy on its checkpoint storage (`shared.py`), looked in before building and
    published to after; `wait_limit_s`: the longest a pod waits for another pod's build of
    the same entry (`build_claim.py`) before building itself."""

    directory: Path
    limit_bytes: int | None = None
    shared: SharedCache | None = None
    wait_limit_s: float | None = None


@contextlib.contextmanager
def locked(path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """An exclusive flock on `path` (created if missing); yields False when `blocking` is
    off and someone else holds it. The kernel drops it when its holder dies."""
    with open(path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _usage(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def evict_others(directory: Path, key: str) -> None:
    """Removes the entries (and leftovers of crashed builds) of other keys that no process
    is building now. Lock files stay: deleting one a process has open would let a second
    process lock a new file of the same name while the first holds the old one."""
    for lock in directory.glob("*.lock"):
        other = lock.name.removesuffix(".lock")
        if other == key:
            continue
        with locked(lock, blocking=False) as free:
            if free:
                for path in directory.glob(f"{other}*"):
                    if path != lock:
                        remove(path)


def budget_for(limit_bytes: int | None, used_bytes: int, free_bytes: int) -> int:
    """Pure: bytes a new entry may take: what the limit leaves after the entries already
    there, and never more than the volume's free space."""
    if limit_bytes is None:
        return free_bytes
    return max(0, min(limit_bytes - used_bytes, free_bytes))


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


Build = Callable[[EntryWriter], int]  # writes the blocks, returns the sample count


def cached_entry(
    settings: CacheSettings,
    key: str,
    build: Build,
    *,
    dtype: np.dtype[Any],
    seq_len: int,
    source_bytes: int | None = None,
) -> tuple[Entry | None, str]:
    """The entry for `key`, built here if no intact one exists; and what happened: `hit`,
    `shared hit` (copied from the job's shared copy), `built`, or `skipped` (too big for the
    cache: the caller tokenizes in memory). Local ranks serialise on the key's lock, so one
    fetches or builds while the others wait, then find it. An error of the data itself (a
    field missing) propagates, leaving no entry. A built entry is published to the shared
    copy after the lock is released (the other local ranks map it meanwhile), and the pod's
    claim on building it (`build_claim.py`: the pods of a fresh job wait for one builder,
    given `source_bytes`, the corpus's size, to bound the wait) is released after that."""
    directory = settings.directory
    directory.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as claim:
        # The other local ranks wait on the lock: they see this rank's progress (startup_progress).
        with locked(directory / f"{key}.lock"), PROGRESS.echoed(directory / f"{key}.progress"):
            entry, outcome, shared_damaged = _find_or_build(
                settings, key, build, dtype, seq_len, claim, source_bytes
            )
        if settings.shared is not None and outcome in ("built", "shared hit"):
            _share(settings.shared, key, directory / key, publish=outcome == "built",
                   replace=shared_damaged)  # fmt: skip
    return entry, outcome


def _find_or_build(
    settings: CacheSettings,
    key: str,
    build: Build,
    dtype: np.dtype[Any],
    seq_len: int,
    claim: contextlib.ExitStack,
    source_bytes: int | None,
) -> tuple[Entry | None, str, bool]:
    """Under the key's lock: the local entry, else the shared one (waiting for another pod's
    build of it), else a build; and whether a shared entry was found damaged (so the build
    replaces it). A build claim taken is entered into `claim`."""
    directory = settings.directory
    final = directory / key
    entry = open_entry(final, key, remember=True)
    if entry is not None:
        return entry, "hit", False
    if (directory / f"{key}.skip").exists():
        return None, "skipped", False
    for stale in [final, *directory.glob(f"{key}.tmp-*")]:
        remove(stale)  # ours to clear: we hold the key's lock
    evict_others(directory, key)
    budget = budget_for(settings.limit_bytes, _usage(directory), _free_bytes(directory))
    tmp = directory / f"{key}.tmp-{os.getpid()}"
    damaged = False
    election = None
    if settings.shared is not None:
        entry, damaged = _fetch(settings.shared, key, tmp, budget)
        if entry is None and not damaged:  # nobody published it: wait for its builder?
            shared = settings.shared
            election = shared.await_build(
                key,
                lambda: _fetch(shared, key, tmp, budget)[0],
                wait_bound(source_bytes, settings.wait_limit_s),
                budget,
            )
            entry = election.found if election is not None else None
            if election is not None and election.skip:
                write_synced(directory / f"{key}.skip", b"too big (another pod found)")
                return None, "skipped", False
            if election is not None and election.claim is not None:
                claim.enter_context(election.claim.held())
        if entry is not None:
            _install(tmp, final)
            return entry, "shared hit", False  # mapped before the rename: the same file
    tmp.mkdir()
    writer = EntryWriter(tmp, budget)
    if election is not None and election.claim is not None:
        election.claim.progress = lambda: writer.bytes  # in its heartbeat, for the waiters
    try:
        samples = build(writer)
        writer.finish(key=key, dtype=dtype, seq_len=seq_len, samples=samples)
    except CacheFullError as e:
        writer.abort()
        remove(tmp)
        log.warning("data cache: the blocks do not fit (%s): not cached", e)
        write_synced(directory / f"{key}.skip", str(e).encode())
        if election is not None and election.claim is not None:
            election.claim.mark_skipped(str(e), budget)
        return None, "skipped", damaged
    except BaseException:
        writer.abort()
        remove(tmp)
        raise
    if writer.rows == 0:  # nothing to map; the caller refuses the dataset
        remove(tmp)
        return None, "skipped", damaged
    _install(tmp, final)
    entry = open_entry(final, key, remember=True)
    return entry, "built" if entry is not None else "skipped", damaged


def _install(tmp: Path, final: Path) -> None:
    fsync_dir(tmp)
    os.rename(tmp, final)  # atomic: readers see a whole entry or none
    fsync_dir(final.parent)


# What the shared copy may raise: its filesystem or store failing (OSError, which covers the
# object store's errors through fsspec), a damaged meta (ValueError, KeyError, TypeError), or
# the checkpoint root belonging to another job (an UnsupportedConfigError the checkpointer
# raises again, failing the job, a moment later). None of them stops training here: sharing
# only saves time, and the pod tokenizes instead.
_SHARED_ERRORS = (OSError, ValueError, KeyError, TypeError)


def _fetch(shared: SharedCache, key: str, tmp: Path, budget: int) -> tuple[Entry | None, bool]:
    """The shared entry copied into `tmp` and verified (size, checksum), or None; and
    whether one was there but damaged."""
    tmp.mkdir()
    try:
        outcome = shared.fetch(key, tmp, budget)
    except _SHARED_ERRORS as e:
        log.warning(
            "data cache: the shared copy %s cannot be read (%r): tokenizing", shared.root, e
        )
        outcome = "unreadable"
    entry = open_entry(tmp, key, remember=True) if outcome == "copied" else None
    if entry is None and outcome in ("copied", "damaged"):
        log.warning("data cache: the shared entry %s is damaged: rebuilding and replacing it", key)
        remove(tmp)
        return None, True
    if entry is None:
        remove(tmp)
    return entry, False


def _share(shared: SharedCache, key: str, entry: Path, *, publish: bool, replace: bool) -> None:
    # A volume's copy reports its chunks as start-up progress; an object store's upload
    # reports nothing until its PUTs complete: allowed the entry at a slow 10 MB/s on top of
    # the stall limit (startup_progress.stall_limit), as a hub download's largest file is.
    slow_s = 0.0 if shared.root.is_local else _usage(entry) / PUBLISH_SLOW_BYTES_PER_S
    try:
        if publish:
            t0 = time.perf_counter()
            with phase("data cache publication", extra_s=slow_s):
                outcome = shared.publish(key, entry, replace=replace)
            log.info("data cache: entry %s %s to %s in %.2f s", key, outcome, shared.root,
                     time.perf_counter() - t0)  # fmt: skip
        for name in shared.prune(keep=key):
            log.info(
                "data cache: removed %s from %s (not this job's current data)", name, shared.root
            )
    except _SHARED_ERRORS as e:
        log.warning("data cache: could not publish to %s (%r); pods replacing this one will "
                    "tokenize again", shared.root, e)  # fmt: skip
