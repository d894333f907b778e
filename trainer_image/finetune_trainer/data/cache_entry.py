"""One entry of the tokenized-blocks cache (`cache.py`): its files and their check.

    blocks.bin    the blocks, row-major, `meta.dtype`, shape (rows, seq_len)
    meta.json     written last: format version, key, shape, dtype, samples, xxh3-128 of blocks.bin

`EntryWriter` streams the blocks into a new entry's directory within a byte budget, hashing
as it goes, and writes the meta last; `open_entry` maps an entry read-only only if its meta
names the key asked for and its bytes match the size and checksum written, so a truncated or
corrupted entry (a local one, or one copied from the job's shared copy, `shared.py`) is never
read.
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
BLOCKS_FILE, META_FILE = "blocks.bin", "meta.json"
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
        write_synced(self.directory / META_FILE, json.dumps(meta).encode())

    def abort(self) -> None:
        self.file.close()
