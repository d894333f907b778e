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
    <key>/blocks.bin    the blocks, row-major, `meta.dtype`, shape (rows, seq_len)
    <key>/meta.json     written last: key, shape, dtype, pad id, xxh3-128 of blocks.bin
    <key>.tmp-<pid>/    an entry being built; renamed to <key>/ once complete
    <key>.skip          the blocks do not fit the cache's limit: every rank tokenizes itself

The key hashes everything that determines the blocks (`cache_key`), so a changed file, a
different tokenizer, sequence length, packing, field or format version is a different entry.
An entry is used only if its meta matches the key and its bytes match the checksum: a crash
mid-build leaves only a `.tmp-*` directory (removed by the next builder), and a truncated or
corrupted entry is rebuilt, never read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from finetune_operator.api.spec import DatasetSpec
from finetune_trainer.data.records import dataset_files, resolve_uri

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# Bump whenever the blocks a given input yields change (tokenizing, packing, file layout).
CACHE_FORMAT_VERSION = 1
BLOCKS_FILE, META_FILE = "blocks.bin", "meta.json"
_HASH_CHUNK = 64 << 20


@dataclass(frozen=True)
class CacheSettings:
    """Where entries live and how many bytes they may take in all (the volume's sizeLimit
    less a margin: a pod whose emptyDir outgrows its sizeLimit is evicted)."""

    directory: Path
    limit_bytes: int | None = None


class CacheFullError(Exception):
    """The blocks would not fit the cache's limit or the volume's free space."""


def files_identity(spec: DatasetSpec) -> list[list[Any]] | None:
    """(path, size, mtime ns) of every input file; None for a Hugging Face hub id, whose
    content cannot be checked without the network: such datasets are not cached. Content is
    not hashed (reading GBs at every start is what the cache avoids); a file rewritten in
    place keeping its size and mtime to the nanosecond would go unnoticed."""
    if spec.format in ("jsonl", "parquet"):
        paths = [Path(p) for p in dataset_files(spec)]
    else:
        root = Path(resolve_uri(spec.uri))
        if not root.is_dir():
            return None
        paths = sorted(p for p in root.rglob("*") if p.is_file())
    out: list[list[Any]] = []
    for path in paths:
        st = path.stat()
        out.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    return out


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of what decides the ids: the full tokenizer definition (fast tokenizers'
    serialized pipeline, else the vocabulary), special tokens and chat template."""
    import tokenizers
    import transformers

    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extra = [
        type(tokenizer).__name__,
        len(tokenizer),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.chat_template,
        transformers.__version__,
        tokenizers.__version__,
    ]
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def cache_key(
    spec: DatasetSpec, files: list[list[Any]], tokenizer_id: str, seq_len: int, dtype: str
) -> str:
    """Pure: the entry name for these inputs. Every DatasetSpec field is in it, so a field
    added later cannot be forgotten here."""
    payload = {
        "version": CACHE_FORMAT_VERSION,
        "dataset": spec.model_dump(mode="json"),
        "files": files,
        "tokenizer": tokenizer_id,
        "sequence_length": seq_len,
        "dtype": dtype,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


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


def open_entry(path: Path, key: str) -> Entry | None:
    """The entry's blocks, mapped read-only, or None (logged) unless it is complete and
    intact: its meta names this key, the file has exactly the size the shape says, and its
    bytes hash to the checksum written when it was built."""
    try:
        meta = json.loads((path / META_FILE).read_text())
        if meta.get("version") != CACHE_FORMAT_VERSION or meta.get("key") != key:
            raise ValueError("built for other inputs")
        dtype, rows, seq_len = np.dtype(meta["dtype"]), int(meta["rows"]), int(meta["seq_len"])
        size = (path / BLOCKS_FILE).stat().st_size
        if size != rows * seq_len * dtype.itemsize or rows < 1:
            raise ValueError(f"{size} bytes where {rows} x {seq_len} {dtype} blocks were written")
        blocks: np.memmap[Any, np.dtype[Any]] = np.memmap(
            path / BLOCKS_FILE, dtype=dtype, mode="r", shape=(rows, seq_len)
        )
        if _checksum(blocks) != meta["xxh3_128"]:
            raise ValueError("checksum mismatch")
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
        _write_synced(self.directory / META_FILE, json.dumps(meta).encode())

    def abort(self) -> None:
        self.file.close()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
                        _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
) -> tuple[Entry | None, str]:
    """The entry for `key`, built here if no intact one exists; and what happened: `hit`,
    `built`, or `skipped` (too big for the cache: the caller tokenizes in memory). Local
    ranks serialise on the key's lock, so one builds while the others wait, then find it.
    An error of the data itself (a field missing) propagates, leaving no entry."""
    directory = settings.directory
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / key
    with locked(directory / f"{key}.lock"):
        entry = open_entry(final, key)
        if entry is not None:
            return entry, "hit"
        if (directory / f"{key}.skip").exists():
            return None, "skipped"
        for stale in [final, *directory.glob(f"{key}.tmp-*")]:
            _remove(stale)  # ours to clear: we hold the key's lock
        evict_others(directory, key)
        budget = budget_for(settings.limit_bytes, _usage(directory), _free_bytes(directory))
        tmp = directory / f"{key}.tmp-{os.getpid()}"
        tmp.mkdir()
        writer = EntryWriter(tmp, budget)
        try:
            samples = build(writer)
            writer.finish(key=key, dtype=dtype, seq_len=seq_len, samples=samples)
        except CacheFullError as e:
            writer.abort()
            _remove(tmp)
            log.warning("data cache: the blocks do not fit (%s): not cached", e)
            _write_synced(directory / f"{key}.skip", str(e).encode())
            return None, "skipped"
        except BaseException:
            writer.abort()
            _remove(tmp)
            raise
        if writer.rows == 0:  # nothing to map; the caller refuses the dataset
            _remove(tmp)
            return None, "skipped"
        _fsync_dir(tmp)
        os.rename(tmp, final)  # atomic: readers see a whole entry or none
        _fsync_dir(directory)
        entry = open_entry(final, key)
        return entry, "built" if entry is not None else "skipped"
