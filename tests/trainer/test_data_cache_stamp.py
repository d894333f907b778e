"""The data cache verifies a pod's entry once (finetune_trainer.data.cache_entry): later opens
skip the full read while the file is unchanged, and any change means a full verification
(and a rebuild of a damaged entry), never a damaged entry read."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from finetune_operator.api.spec import DatasetSpec
from finetune_trainer.data import CacheSettings, TokenBlocks, build_dataset
from finetune_trainer.data import cache_entry as entry_mod
from finetune_trainer.data.cache_entry import (
    BLOCKS_FILE,
    STAMP_FILE,
    EntryWriter,
    open_entry,
    stamp_for,
    stamped,
)
from finetune_trainer.tokenizer import build_byte_tokenizer
from tests.trainer.test_data_cache import write_corpus

SEQ = 16


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many full reads (checksums of an entry's blocks) were made."""
    calls: list[int] = []
    real = entry_mod._checksum

    def counting(blocks: Any) -> str:
        calls.append(int(blocks.nbytes))
        return real(blocks)

    monkeypatch.setattr(entry_mod, "_checksum", counting)
    return calls


def build(spec: DatasetSpec, cache: Path) -> TokenBlocks:
    return build_dataset(spec, build_byte_tokenizer(), SEQ, CacheSettings(cache))


def the_entry(cache: Path) -> Path:
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    return entry


def is_racy(entry: Path) -> bool:
    """The stamp was written in the blocks' last clock tick: not trusted (`stamped`)."""
    return (entry / STAMP_FILE).stat().st_mtime_ns <= (entry / BLOCKS_FILE).stat().st_ctime_ns


def test_a_restart_maps_the_entry_without_reading_it_again(
    tmp_path: Path, hashed: list[int]
) -> None:
    spec = DatasetSpec(uri=str(write_corpus(tmp_path / "data.jsonl")))
    first = build(spec, tmp_path / "cache")
    assert first.source == "cache built" and len(hashed) == 1  # verified once, after the build
    entry = the_entry(tmp_path / "cache")
    # A stamp written within the file's last clock tick is not trusted (`stamped`): then the
    # first restart reads it once more, and stamps it for good.
    racy = is_racy(entry)
    for _ in range(3):  # torchelastic restarts of the pod's workers
        again = build(spec, tmp_path / "cache")
        assert again.source == "cache hit"
        assert np.array_equal(again.blocks, first.blocks)
    assert len(hashed) == 1 + racy


def _flip(blocks: Path) -> None:
    with open(blocks, "r+b") as f:
        f.seek(os.path.getsize(blocks) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def _change(blocks: Path, how: str) -> None:
    st = blocks.stat()
    if how == "bytes-changed-in-place":  # same size, same inode, a new mtime
        _flip(blocks)
    elif how == "bytes-changed-mtime-set-back":  # only the ctime says so
        _flip(blocks)
        os.utime(blocks, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert blocks.stat().st_mtime_ns == st.st_mtime_ns
    elif how == "file-rewritten":  # someone wrote a new file in its place
        data = bytearray(blocks.read_bytes())
        data[len(data) // 2] ^= 0x01
        other = blocks.with_name("rewritten")
        other.write_bytes(bytes(data))
        os.replace(other, blocks)
        assert blocks.stat().st_ino != st.st_ino


@pytest.mark.parametrize(
    "how", ["bytes-changed-in-place", "bytes-changed-mtime-set-back", "file-rewritten"]
)
def test_an_entry_changed_after_its_stamp_is_verified_again_and_rebuilt(
    how: str, tmp_path: Path, hashed: list[int]
) -> None:
    spec = DatasetSpec(uri=str(write_corpus(tmp_path / "data.jsonl")))
    good = np.array(build(spec, tmp_path / "cache").blocks)
    _change(the_entry(tmp_path / "cache") / BLOCKS_FILE, how)
    before = len(hashed)
    again = build(spec, tmp_path / "cache")
    assert again.source == "cache built"  # the damage was found by a full read: rebuilt
    assert len(hashed) == before + 2  # the damaged entry's read, the rebuilt one's
    assert np.array_equal(again.blocks, good)
    racy = is_racy(the_entry(tmp_path / "cache"))
    assert build(spec, tmp_path / "cache").source == "cache hit"
    assert len(hashed) == before + 2 + racy  # and the rebuilt entry is stamped in turn


def test_a_stamp_vouches_only_for_the_file_it_saw(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    st = path.stat()
    stamp = json.dumps(stamp_for(st, "c" * 32, "boot-1")).encode()
    later = st.st_ctime_ns + 1
    assert stamped(stamp, later, st, "c" * 32, "boot-1")
    assert not stamped(stamp, later, st, "d" * 32, "boot-1")  # the meta names another checksum
    assert not stamped(stamp, later, st, "c" * 32, "boot-2")  # the node rebooted since
    assert not stamped(None, later, st, "c" * 32, "boot-1")
    assert not stamped(b"{torn", later, st, "c" * 32, "boot-1")
    assert not stamped(stamp, later, st, "c" * 32, None)  # no boot id: nothing to tie it to
    # Written in the file's last tick: a change later in that tick would keep its ctime.
    assert not stamped(stamp, st.st_ctime_ns, st, "c" * 32, "boot-1")
    path.write_bytes(b"y" * 10)
    assert not stamped(stamp, later, path.stat(), "c" * 32, "boot-1")


def test_only_the_pods_own_entry_is_stamped(tmp_path: Path, hashed: list[int]) -> None:
    """open_entry without `remember` (the shared copy, another pod's): verified every time,
    nothing written into it."""
    writer = EntryWriter(tmp_path, None)
    writer.write(np.arange(64, dtype=np.uint16).reshape(4, SEQ))
    writer.finish(key="k", dtype=np.dtype(np.uint16), seq_len=SEQ, samples=4)
    assert open_entry(tmp_path, "k") is not None and open_entry(tmp_path, "k") is not None
    assert len(hashed) == 2 and not (tmp_path / STAMP_FILE).exists()


def test_a_read_that_moves_the_atime_still_stamps(tmp_path: Path) -> None:
    """Reading the blocks may update their access time (relatime: the first read after a
    write, or with an atime older than the mtime): that is no change of their bytes, and must
    not keep the entry unstamped (verified again at every open, the cost the stamp saves)."""
    writer = EntryWriter(tmp_path, None)
    writer.write(np.arange(64, dtype=np.uint16).reshape(4, SEQ))
    writer.finish(key="k", dtype=np.dtype(np.uint16), seq_len=SEQ, samples=4)
    blocks = tmp_path / BLOCKS_FILE
    st = blocks.stat()
    os.utime(blocks, ns=(st.st_mtime_ns - 10**10, st.st_mtime_ns))  # an atime relatime moves
    time.sleep(0.05)  # past the ctime's tick: the stamp is then trusted, not racy
    assert open_entry(tmp_path, "k", remember=True) is not None
    assert (tmp_path / STAMP_FILE).exists()
