"""The job's shared copy of the data cache (finetune_trainer.data.shared): a replacement pod
(its own, empty local cache; the job's checkpoint storage) copies the entry instead of
tokenizing; a damaged or partial shared entry is never installed; publishers racing on real
processes leave one whole entry; old entries do not pile up; another job's storage is left
alone."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.api.spec import CheckpointSpec, DatasetSpec
from finetune_trainer.config import RuntimeEnv
from finetune_trainer.data import CacheSettings, TokenBlocks, build_dataset, records
from finetune_trainer.data.cache_entry import BLOCKS_FILE, META_FILE, EntryWriter, open_entry
from finetune_trainer.data.cache_key import cache_key
from finetune_trainer.data.shared import (
    ABANDONED_SECONDS,
    SHARED_DIR,
    SharedCache,
    _publish_local,
    is_abandoned,
    shared_cache_for,
)
from finetune_trainer.ownership import OWNER_FILE
from finetune_trainer.tokenizer import build_byte_tokenizer
from finetune_trainer.trainer import data_cache
from tests.objectstore import MotoServer
from tests.trainer.test_data_cache import SEQ, write_corpus

OWNER = {"job": "quickstart", "namespace": "default", "uid": "uid-1"}


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "data.jsonl")


def shared_for(ckpt: Path, owner: dict[str, str] = OWNER) -> SharedCache:
    shared = shared_cache_for(CheckpointSpec(uri=str(ckpt)), None, owner)
    assert shared is not None
    return shared


def pod(spec: DatasetSpec, local: Path, ckpt: Path | SharedCache, *, tok: Any = None,
        owner: dict[str, str] = OWNER) -> TokenBlocks:  # fmt: skip
    """One pod's data phase: its own local cache directory, the job's checkpoint directory."""
    shared = ckpt if isinstance(ckpt, SharedCache) else shared_for(ckpt, owner)
    settings = CacheSettings(local, None, shared)
    return build_dataset(spec, tok or build_byte_tokenizer(), SEQ, settings)


def entries(ckpt: Path) -> list[str]:
    return sorted(p.name for p in (ckpt / SHARED_DIR).iterdir())


def forbid_tokenizing(monkeypatch: pytest.MonkeyPatch) -> Any:
    tok = build_byte_tokenizer()

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a replacement pod must not read or tokenize the corpus")

    monkeypatch.setattr(type(tok), "__call__", forbidden)
    monkeypatch.setattr(records, "_jsonl_rows", forbidden)
    return tok


def test_a_replacement_pod_copies_the_entry_and_never_tokenizes(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, ckpt = DatasetSpec(uri=str(corpus)), tmp_path / "ckpt"
    first = pod(spec, tmp_path / "node-a", ckpt)
    assert first.source == "cache built"
    (key,) = entries(ckpt)
    assert sorted(p.name for p in (ckpt / SHARED_DIR / key).iterdir()) == [BLOCKS_FILE, META_FILE]
    assert json.loads((ckpt / OWNER_FILE).read_text())["uid"] == "uid-1"  # claimed before writing

    tok = forbid_tokenizing(monkeypatch)
    second = pod(spec, tmp_path / "node-b", ckpt, tok=tok)
    assert second.source == "cache shared hit"
    assert np.array_equal(second.blocks, first.blocks)
    assert isinstance(second.blocks, np.memmap)  # mapped from the local copy, not the share
    assert Path(second.blocks.filename).parent.parent == tmp_path / "node-b"
    # Its restarts hit its own copy.
    assert pod(spec, tmp_path / "node-b", ckpt, tok=tok).source == "cache hit"
    assert not list((tmp_path / "node-b").glob("*.tmp-*"))


def test_key_ignores_the_cache_size() -> None:
    """Resizing the volume must not rebuild (or stop sharing) the same blocks."""
    spec = DatasetSpec(uri="/d.jsonl")
    bigger = DatasetSpec(uri="/d.jsonl", cache_size_limit="100Gi")
    files = [["/d.jsonl", 10, 1]]
    assert cache_key(spec, files, "t", 16, "<u2") == cache_key(bigger, files, "t", 16, "<u2")


def _damage_shared(entry: Path, how: str) -> None:
    blocks, meta = entry / BLOCKS_FILE, entry / META_FILE
    if how == "truncated":
        blocks.write_bytes(blocks.read_bytes()[:-2])
    elif how == "flipped-byte":
        data = bytearray(blocks.read_bytes())
        data[len(data) // 3] ^= 0x10
        blocks.write_bytes(bytes(data))
    elif how == "blocks-missing":
        blocks.unlink()
    elif how == "meta-missing":
        meta.unlink()
    elif how == "meta-garbage":
        meta.write_text("{half a meta")
    elif how == "checksum-of-other-bytes":
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "xxh3_128": "0" * 32}))


@pytest.mark.parametrize(
    "how",
    [
        "truncated",
        "flipped-byte",
        "blocks-missing",
        "meta-missing",
        "meta-garbage",
        "checksum-of-other-bytes",
    ],
)
def test_a_damaged_shared_entry_is_rebuilt_never_read_and_replaced(
    how: str, corpus: Path, tmp_path: Path
) -> None:
    spec, ckpt = DatasetSpec(uri=str(corpus)), tmp_path / "ckpt"
    good = np.array(pod(spec, tmp_path / "node-a", ckpt).blocks)
    (key,) = entries(ckpt)
    _damage_shared(ckpt / SHARED_DIR / key, how)
    again = pod(spec, tmp_path / "node-b", ckpt)
    assert again.source == "cache built"  # tokenized: the damaged copy was not installed
    assert np.array_equal(again.blocks, good)
    assert entries(ckpt) == [key]  # replaced in place, nothing left aside
    assert open_entry(ckpt / SHARED_DIR / key, key) is not None
    assert pod(spec, tmp_path / "node-c", ckpt).source == "cache shared hit"


def test_a_partial_publication_is_never_read_and_is_cleaned_once_abandoned(
    corpus: Path, tmp_path: Path
) -> None:
    """A publisher killed mid-copy leaves only its temporary directory: not an entry (the
    next pod tokenizes and publishes), removed once nobody has written it for a while."""
    spec, ckpt = DatasetSpec(uri=str(corpus)), tmp_path / "ckpt"
    pod(spec, tmp_path / "node-a", ckpt)
    (key,) = entries(ckpt)
    shared = ckpt / SHARED_DIR
    partial = shared / f".{key}.tmp-deadhost-123"
    os.rename(shared / key, partial)  # as if the rename never happened
    (partial / META_FILE).unlink()
    assert pod(spec, tmp_path / "node-b", ckpt).source == "cache built"
    assert entries(ckpt) == sorted([key, partial.name])  # young: maybe still being written
    now = time.time()
    assert shared_for(ckpt).prune(keep=key, now=now) == []
    assert shared_for(ckpt).prune(keep=key, now=now + ABANDONED_SECONDS + 5) == [partial.name]
    assert entries(ckpt) == [key]


@pytest.mark.parametrize(
    ("age", "abandoned"),
    [(0.0, False), (ABANDONED_SECONDS - 1, False), (ABANDONED_SECONDS + 1, True)],
)
def test_is_abandoned(age: float, abandoned: bool) -> None:
    assert is_abandoned(1000.0, 1000.0 + age) is abandoned


def test_entries_of_other_data_are_removed_checkpoints_never(corpus: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    step = ckpt / "step-00000010"
    step.mkdir(parents=True)
    (step / "COMMITTED").write_text("{}")
    (step / "__0_0.distcp").write_bytes(b"shard")
    pod(DatasetSpec(uri=str(corpus)), tmp_path / "node-a", ckpt)
    (old,) = entries(ckpt)
    corpus.write_text(corpus.read_text() + '{"text": "a new row"}\n')  # the data changed
    assert pod(DatasetSpec(uri=str(corpus)), tmp_path / "node-b", ckpt).source == "cache built"
    (new,) = entries(ckpt)
    assert new != old
    assert sorted(p.name for p in step.iterdir()) == ["COMMITTED", "__0_0.distcp"]
    assert sorted(p.name for p in ckpt.iterdir()) == [SHARED_DIR, OWNER_FILE, "step-00000010"]


def test_another_jobs_storage_is_neither_read_nor_written(corpus: Path, tmp_path: Path) -> None:
    spec, ckpt = DatasetSpec(uri=str(corpus)), tmp_path / "ckpt"
    pod(spec, tmp_path / "node-a", ckpt)
    (key,) = entries(ckpt)
    other = {"job": "other", "namespace": "team-b", "uid": "uid-2"}
    before = (ckpt / SHARED_DIR / key / BLOCKS_FILE).stat().st_mtime_ns
    # The other job's pod tokenizes (its checkpointer then refuses the directory, failing it).
    assert pod(spec, tmp_path / "node-x", ckpt, owner=other).source == "cache built"
    assert (ckpt / SHARED_DIR / key / BLOCKS_FILE).stat().st_mtime_ns == before
    assert json.loads((ckpt / OWNER_FILE).read_text())["uid"] == "uid-1"


def test_unreachable_shared_storage_only_costs_the_tokenizing(corpus: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.write_text("a file where the directory should be")  # every access fails
    ds = pod(DatasetSpec(uri=str(corpus)), tmp_path / "node-a", ckpt)
    assert ds.source == "cache built" and len(ds) > 0


def test_the_trainer_shares_through_its_checkpoint_root(tmp_path: Path) -> None:
    from tests.trainer.conftest import make_job

    job: JobConfig = make_job(checkpoint={"uri": str(tmp_path / "c")})
    env = RuntimeEnv.from_environ({"FT_DATA_CACHE_DIR": str(tmp_path / "local")})
    settings = data_cache(env, job)
    assert settings is not None and settings.shared is not None
    assert settings.shared.root.local_path == tmp_path / "c" / SHARED_DIR
    off = make_job(checkpoint={"uri": str(tmp_path / "c"), "enabled": False})
    disabled = data_cache(env, off)
    assert disabled is not None and disabled.shared is None  # no storage of its own to use
    assert data_cache(RuntimeEnv.from_environ({}), job) is None
    # A pod waits for another's build at most half the startup collective timeout.
    assert settings.wait_limit_s is None
    waiting = data_cache(env, job, startup_timeout_s=600.0)
    assert waiting is not None and waiting.wait_limit_s == 300.0


def test_through_object_storage(
    s3_credentials: MotoServer, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s3:// checkpoints (moto's server over HTTP, the trainer's own s3fs client): the same
    sharing, the blocks put before the meta, a damaged object replaced, old keys removed."""
    uri = f"s3://{s3_credentials.new_bucket()}/ckpt/job"

    def shared() -> SharedCache:
        made = shared_cache_for(CheckpointSpec(uri=uri), s3_credentials.spec(), OWNER)
        assert made is not None
        return made

    spec = DatasetSpec(uri=str(corpus))
    first = pod(spec, tmp_path / "node-a", shared())
    assert first.source == "cache built"
    root = shared().root
    (key,) = [e.name for e in root.children()]
    assert sorted(root.fs.ls(f"{root.path}/{key}", detail=False)) == sorted(
        f"{root.path}/{key}/{n}" for n in (BLOCKS_FILE, META_FILE)
    )
    blocks = root / key / BLOCKS_FILE
    data = bytearray(blocks.read_bytes())
    data[7] ^= 0x01
    root.fs.pipe_file(blocks.path, bytes(data))  # same size: only the checksum can tell
    assert pod(spec, tmp_path / "node-b", shared()).source == "cache built"
    (root / ("0" * 32) / META_FILE).write_atomic(b"{}")  # an entry of older data
    tok = forbid_tokenizing(monkeypatch)
    third = pod(spec, tmp_path / "node-c", shared(), tok=tok)
    assert third.source == "cache shared hit" and np.array_equal(third.blocks, first.blocks)
    assert [e.name for e in root.children()] == [key]


def test_other_keys_claims_on_object_storage_are_removed_once_abandoned(
    s3_credentials: MotoServer,
) -> None:
    """An object store has no temporary directories, but it has other keys' build claims and
    skip markers (a builder that died, then the data changed): not kept for good."""
    uri = f"s3://{s3_credentials.new_bucket()}/ckpt/job"
    made = shared_cache_for(CheckpointSpec(uri=uri), s3_credentials.spec(), OWNER)
    assert made is not None
    key, old = "k" * 32, "0" * 32
    names = [f".{old}.building", f".{old}.skip", f".{key}.building"]
    for name in names:
        (made.root / name).write_atomic(b"{}")
    assert made.prune(keep=key, now=time.time()) == []  # a live claim is rewritten often
    later = time.time() + ABANDONED_SECONDS + 60
    assert sorted(made.prune(keep=key, now=later)) == sorted(names[:2])
    assert [e.name for e in made.root.children()] == [f".{key}.building"]


def test_one_publisher_at_a_time_and_a_dead_ones_claim_is_taken_over(tmp_path: Path) -> None:
    key = "k" * 32
    entry = _local_entry(tmp_path / "local" / key, key)
    shared = shared_for(tmp_path / "ckpt")
    claim = tmp_path / "ckpt" / SHARED_DIR / f".{key}.publishing"
    claim.parent.mkdir(parents=True)
    claim.touch()  # another pod is copying it now
    assert shared.publish(key, entry) == "in progress"
    assert entries(tmp_path / "ckpt") == [claim.name]
    old = time.time() - ABANDONED_SECONDS - 5
    os.utime(claim, (old, old))  # that pod died mid-copy
    assert shared.publish(key, entry) == "published"
    assert entries(tmp_path / "ckpt") == [key]  # its claim released
    assert shared.publish(key, entry) == "present"


# ---- publishers racing, on real processes ----------------------------------------------------

ROWS, WIDTH = 4096, 256  # 2 MiB of uint16 blocks: copies long enough to overlap


def _local_entry(directory: Path, key: str) -> Path:
    blocks = np.random.default_rng(1).integers(0, 60000, size=(ROWS, WIDTH), dtype=np.uint16)
    directory.mkdir(parents=True)
    writer = EntryWriter(directory, None)
    writer.write(blocks)
    writer.finish(key=key, dtype=np.dtype(np.uint16), seq_len=WIDTH, samples=ROWS)
    return directory


def _publisher(ckpt: str, entry: str, key: str, claim: bool, start: Any, out: Any) -> None:
    shared = shared_for(Path(ckpt))
    shared.root.makedirs()
    start.wait()
    if claim:
        out.put(shared.publish(key, Path(entry)))
    else:  # as publishers that all took over a stale claim: only the rename keeps it safe
        meta = json.loads((Path(entry) / META_FILE).read_text())
        out.put(_publish_local(shared.root.local_path, key, Path(entry), meta, replace=False))


def _reader(ckpt: str, key: str, work: str, start: Any, stop: Any, out: Any) -> None:
    """Fetches over and over while the publishers run: every copy it gets must verify."""
    shared = shared_for(Path(ckpt))
    start.wait()
    seen = {"absent": 0, "whole": 0, "damaged": 0}
    n = 0
    while not stop.is_set() or n == 0:
        into = Path(work) / f"r{n}"
        into.mkdir()
        if shared.fetch(key, into, 1 << 40) != "copied":
            seen["absent"] += 1
        else:
            seen["whole" if open_entry(into, key) is not None else "damaged"] += 1
        n += 1
    out.put(seen)


@pytest.mark.parametrize("claim", [True, False], ids=["claimed", "racing-renames"])
def test_concurrent_publishers_leave_one_whole_entry_and_readers_never_see_part(
    claim: bool, tmp_path: Path
) -> None:
    key = "k" * 32
    ckpt = tmp_path / "ckpt"
    entry = _local_entry(tmp_path / "local" / key, key)
    ctx = multiprocessing.get_context("fork")
    n = 4
    start, stop = ctx.Barrier(n + 1), ctx.Event()
    out, seen = ctx.Queue(), ctx.Queue()
    (tmp_path / "reads").mkdir()
    reader = ctx.Process(
        target=_reader, args=(str(ckpt), key, str(tmp_path / "reads"), start, stop, seen)
    )
    publishers = [ctx.Process(target=_publisher, args=(str(ckpt), str(entry), key, claim, start, out))
                  for _ in range(n)]  # fmt: skip
    for p in [reader, *publishers]:
        p.start()
    outcomes = sorted(out.get(timeout=120) for _ in publishers)
    stop.set()
    reads = seen.get(timeout=120)
    for p in [reader, *publishers]:
        p.join(30)
        assert p.exitcode == 0
    if claim:  # one copy written to the shared volume, not one per pod
        assert outcomes == ["in progress"] * (n - 1) + ["published"] or "present" in outcomes
    assert outcomes.count("published") >= 1 and set(outcomes) <= {
        "published",
        "present",
        "in progress",
    }
    assert reads["damaged"] == 0, reads
    assert entries(ckpt) == [key]  # no temporary directory left behind
    published = open_entry(ckpt / SHARED_DIR / key, key)
    assert published is not None
    assert np.array_equal(
        published.blocks, np.fromfile(entry / BLOCKS_FILE, np.uint16).reshape(ROWS, WIDTH)
    )


def test_an_entry_published_while_its_state_is_read_is_not_judged_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another pod's rename lands between this pod's failed read of the meta and its look at
    the directory: the entry was absent when read, and is whole, never damaged (judged
    damaged, it would be moved aside and published again)."""
    from finetune_trainer.location import Location

    key = "k" * 32
    shared = shared_for(tmp_path / "ckpt")
    shared.root.makedirs()
    built = _local_entry(tmp_path / "built" / key, key)
    real = Location.read_text

    def meta_then_rename(self: Location) -> str:
        if self.name == META_FILE and not (shared.root / key).exists():
            try:
                return real(self)
            finally:
                os.rename(built, shared.root.local_path / key)  # the other pod's publication
        return real(self)

    monkeypatch.setattr(Location, "read_text", meta_then_rename)
    assert shared._state(key)[0] == "absent"
    assert shared._state(key)[0] == "whole"
