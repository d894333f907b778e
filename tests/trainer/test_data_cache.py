"""The tokenized-blocks cache (finetune_trainer.data.cache) and the streaming build: the same
blocks and batches as tokenizing everything at once, built once, never read when stale or
damaged."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from finetune_operator.api.spec import DatasetSpec
from finetune_trainer.config import RuntimeEnv
from finetune_trainer.data import CacheSettings, TokenBlocks, build_dataset, records
from finetune_trainer.data.cache import budget_for
from finetune_trainer.data.cache_entry import BLOCKS_FILE, META_FILE
from finetune_trainer.data.cache_key import cache_key
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.sampler import StepSampler
from finetune_trainer.startup import StartupClock
from finetune_trainer.tokenizer import build_byte_tokenizer

CPU = torch.device("cpu")
SEQ = 16
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "cats",
    "sleep",
    "in",
    "warm",
    "sun",
]


def write_corpus(path: Path, rows: int = 120, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(rows):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 12))))
        row: dict[str, Any] = {"text": text, "id": i}
        if i % 3 == 0:
            row["messages"] = [
                {"role": "user", "content": text},
                {"role": "assistant", "content": "ok"},
            ]
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def reference_blocks(texts: list[str], seq_len: int) -> np.ndarray[Any, Any]:
    """What the trainer built before streaming: every text tokenized at once, bos + ids + eos,
    all concatenated, cut into full blocks."""
    tok = build_byte_tokenizer()
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    flat = [t for s in ids for t in [tok.bos_token_id, *s, tok.eos_token_id]]
    n = len(flat) // seq_len
    return np.array(flat[: n * seq_len]).reshape(n, seq_len)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "data.jsonl")


def build(spec: DatasetSpec, cache: Path | None, seq_len: int = SEQ, **kw: Any) -> TokenBlocks:
    settings = None if cache is None else CacheSettings(cache, kw.pop("limit", None))
    return build_dataset(spec, kw.pop("tok", None) or build_byte_tokenizer(), seq_len, settings)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_streamed_cached_and_uncached_blocks_match_tokenizing_at_once(
    fmt: str, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(records, "BATCH_ROWS", 7)  # many batches, blocks spanning them
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    uri = str(corpus)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        uri = str(tmp_path / "data.parquet")
        pq.write_table(pa.table({"text": texts}), uri, row_group_size=50)
    spec = DatasetSpec(uri=uri, format=fmt)
    expected = reference_blocks(texts, SEQ)
    uncached = build(spec, None)
    first = build(spec, tmp_path / "cache")
    again = build(spec, tmp_path / "cache")
    assert (uncached.source, first.source, again.source) == (
        "tokenized",
        "cache built",
        "cache hit",
    )
    for ds in (uncached, first, again):
        assert np.array_equal(np.asarray(ds.blocks), expected)
    assert isinstance(again.blocks, np.memmap) and again.blocks.dtype == np.uint16


def test_unpacked_chat_rows_cached_as_padded_blocks(corpus: Path, tmp_path: Path) -> None:
    lines = [json.loads(line) for line in corpus.read_text().splitlines()]
    chats = [json.dumps({"messages": row["messages"]}) for row in lines if "messages" in row]
    (tmp_path / "chat.jsonl").write_text("\n".join(chats))
    spec = DatasetSpec(uri=str(tmp_path / "chat.jsonl"), messages_field="messages", packing=False)
    uncached, cached = build(spec, None, 64), build(spec, tmp_path / "cache", 64)
    hit = build(spec, tmp_path / "cache", 64)
    assert hit.source == "cache hit" and len(hit) == len(chats) == 40
    tok = build_byte_tokenizer()
    ids = tok.apply_chat_template(lines[0]["messages"], tokenize=True)["input_ids"]
    first = [*ids, tok.eos_token_id][:64]
    assert np.asarray(hit.blocks)[0, : len(first)].tolist() == first
    for ds in (cached, hit):
        assert np.array_equal(np.asarray(ds.blocks), uncached.blocks)
        assert ds.pad_id == uncached.pad_id == tok.pad_token_id


def steps(ds: TokenBlocks, sampler: StepSampler, n: int) -> list[list[dict[str, torch.Tensor]]]:
    return [[ds.batch(mb, CPU) for mb in sampler.next_step()] for _ in range(n)]


def test_same_batches_and_resume_position_from_the_cache(corpus: Path, tmp_path: Path) -> None:
    """A run on tokenized blocks, interrupted after 3 steps, resumed from the cache (its
    sampler state restored) trains on exactly the batches of an uninterrupted run."""
    spec = DatasetSpec(uri=str(corpus))
    plain = build(spec, None)
    build(spec, tmp_path / "cache")
    cached = build(spec, tmp_path / "cache")
    assert cached.source == "cache hit"

    def sampler(rank: int) -> StepSampler:
        return StepSampler(num_samples=len(plain), global_batch=8, micro_batch_size=2,
                           rank=rank, world_size=2, seed=7)  # fmt: skip

    for rank in (0, 1):
        through = steps(plain, sampler(rank), 6)  # several epochs of this tiny corpus
        first = sampler(rank)
        before = steps(plain, first, 3)
        resumed = sampler(rank)
        resumed.load_state_dict(first.state_dict())
        after = steps(cached, resumed, 3)
        for want, got in zip(through, before + after, strict=True):
            for a, b in zip(want, got, strict=True):
                assert a.keys() == b.keys()
                assert all(torch.equal(a[k], b[k]) for k in a)
        assert cached.count_tokens([0, 3]) == plain.count_tokens([0, 3]) == 2 * SEQ


def test_a_hit_neither_reads_the_records_nor_tokenizes(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = DatasetSpec(uri=str(corpus))
    built = build(spec, tmp_path / "cache")
    tok = build_byte_tokenizer()

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cache hit must not read or tokenize the corpus")

    monkeypatch.setattr(type(tok), "__call__", forbidden)
    monkeypatch.setattr(records, "_jsonl_rows", forbidden)
    hit = build(spec, tmp_path / "cache", tok=tok)
    assert hit.source == "cache hit" and np.array_equal(hit.blocks, built.blocks)


def _touch_later(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


CHANGES = {
    "file-rewritten-same-size": lambda c, spec: (_touch_later(c), spec, SEQ),
    "file-grown": lambda c, spec: (c.write_text(c.read_text() + '{"text": "more"}\n'), spec, SEQ),
    "sequence-length": lambda c, spec: (None, spec, SEQ * 2),
    "packing": lambda c, spec: (None, spec.model_copy(update={"packing": False}), SEQ),
    "text-field": lambda c, spec: (None, spec.model_copy(update={"text_field": "id"}), SEQ),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_any_input_change_is_a_new_entry_and_the_old_one_goes(
    change: str, corpus: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    spec = DatasetSpec(uri=str(corpus))
    build(spec, cache)
    _, spec2, seq = CHANGES[change](corpus, spec)
    rebuilt = build(spec2, cache, seq)
    assert rebuilt.source == "cache built"
    assert np.array_equal(rebuilt.blocks, build(spec2, None, seq).blocks)
    entries = [p for p in cache.iterdir() if p.is_dir()]
    assert len(entries) == 1  # the stale entry was evicted (its lock file stays)


def test_a_different_tokenizer_is_a_different_key(corpus: Path, tmp_path: Path) -> None:
    spec = DatasetSpec(uri=str(corpus))
    build(spec, tmp_path / "cache")
    tok = build_byte_tokenizer()
    tok.chat_template = "{{ messages }}"
    assert build(spec, tmp_path / "cache", tok=tok).source == "cache built"


def test_cache_key_is_pure_and_names_every_input() -> None:
    spec = DatasetSpec(uri="/d.jsonl")
    files = [["/d.jsonl", 10, 1]]
    key = cache_key(spec, files, "tok", 16, "<u2")
    assert key == cache_key(spec, [list(f) for f in files], "tok", 16, "<u2")
    others = [
        cache_key(spec.model_copy(update={"messages_field": "m"}), files, "tok", 16, "<u2"),
        cache_key(spec, [["/d.jsonl", 10, 2]], "tok", 16, "<u2"),
        cache_key(spec, files, "tok2", 16, "<u2"),
        cache_key(spec, files, "tok", 17, "<u2"),
        cache_key(spec, files, "tok", 16, "<u4"),
    ]
    assert len({key, *others}) == 6


def _damage(entry: Path, how: str) -> None:
    blocks, meta = entry / BLOCKS_FILE, entry / META_FILE
    if how == "truncated":
        blocks.write_bytes(blocks.read_bytes()[:-2])
    elif how == "flipped-byte":
        data = bytearray(blocks.read_bytes())
        data[len(data) // 2] ^= 0x01
        blocks.write_bytes(bytes(data))
    elif how == "no-meta":
        meta.unlink()
    elif how == "meta-of-other-inputs":
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "key": "0" * 32}))
    elif how == "meta-garbage":
        meta.write_text("{not json")


@pytest.mark.parametrize("how", ["truncated", "flipped-byte", "no-meta", "meta-of-other-inputs",
                                 "meta-garbage"])  # fmt: skip
def test_a_damaged_entry_is_rebuilt_never_read(how: str, corpus: Path, tmp_path: Path) -> None:
    spec = DatasetSpec(uri=str(corpus))
    good = np.array(build(spec, tmp_path / "cache").blocks)  # a copy: damage is done in place
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    _damage(entry, how)
    again = build(spec, tmp_path / "cache")
    assert again.source == "cache built"
    assert np.array_equal(again.blocks, good)
    assert build(spec, tmp_path / "cache").source == "cache hit"


def test_a_build_that_fails_leaves_no_entry(corpus: Path, tmp_path: Path) -> None:
    """A data error mid-build (as a crash would) leaves only what the next build clears: the
    half-written blocks never become an entry."""
    corpus.write_text(corpus.read_text() + "{oops\n")
    spec = DatasetSpec(uri=str(corpus))
    with pytest.raises(UnsupportedConfigError, match="line 121 is not JSON"):
        build(spec, tmp_path / "cache")
    (lock,) = (tmp_path / "cache").iterdir()  # the key's lock file, nothing else
    # A crashed builder's leftovers (killed before the rename: blocks, no meta) are cleared
    # by the next build, never used.
    corpus.write_text(corpus.read_text().replace("{oops\n", ""))
    leftover = tmp_path / "cache" / lock.name.replace(".lock", ".tmp-99999")
    leftover.mkdir()
    (leftover / BLOCKS_FILE).write_bytes(b"\0" * 64)
    assert build(spec, tmp_path / "cache").source == "cache built"
    assert not leftover.exists()


def _build_until_killed(cache: str, corpus: str, ready: Any) -> None:
    from finetune_trainer.data import cache as cache_module

    write = cache_module.EntryWriter.write

    def write_then_hang(self: Any, blocks: Any) -> None:
        write(self, blocks)
        self.file.flush()
        ready.set()  # blocks on disk, no meta, not renamed: SIGKILL lands here
        time.sleep(60)

    cache_module.EntryWriter.write = write_then_hang  # type: ignore[method-assign]
    build(DatasetSpec(uri=corpus), Path(cache))


def test_a_builder_killed_mid_write_leaves_nothing_that_is_read(
    corpus: Path, tmp_path: Path
) -> None:
    """SIGKILL (torchelastic stopping a worker group, the OOM killer) in the middle of a
    build: the next start finds no entry, clears the half-written one and builds it again."""
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    builder = ctx.Process(
        target=_build_until_killed, args=(str(tmp_path / "c"), str(corpus), ready)
    )
    builder.start()
    assert ready.wait(60), "the builder never wrote"
    os.kill(builder.pid, signal.SIGKILL)
    builder.join(30)
    (partial,) = (tmp_path / "c").glob("*.tmp-*")
    assert (partial / BLOCKS_FILE).stat().st_size > 0 and not (partial / META_FILE).exists()
    again = build(DatasetSpec(uri=str(corpus)), tmp_path / "c")  # the kernel dropped its lock
    assert again.source == "cache built" and not partial.exists()
    assert np.array_equal(again.blocks, build(DatasetSpec(uri=str(corpus)), None).blocks)


def test_missing_field_is_refused_naming_it_and_caches_nothing(
    corpus: Path, tmp_path: Path
) -> None:
    spec = DatasetSpec(uri=str(corpus), text_field="body")
    with pytest.raises(
        UnsupportedConfigError,
        match=r"textField 'body' not in the records \(columns: \['text', 'id', 'messages'\]\)",
    ):
        build(spec, tmp_path / "cache")
    chat = DatasetSpec(uri=str(corpus), messages_field="dialog", packing=False)
    with pytest.raises(UnsupportedConfigError, match="messagesField 'dialog' not in the records"):
        build(chat, tmp_path / "cache", 64)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]


def test_over_the_limit_tokenizes_in_memory_and_every_rank_knows(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = DatasetSpec(uri=str(corpus))
    first = build(spec, tmp_path / "cache", limit=64)
    assert first.source == "tokenized" and len(first) > 2
    assert len(list((tmp_path / "cache").glob("*.skip"))) == 1
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    # The next local rank does not try (and fail) the build again: it goes straight to memory.
    from finetune_trainer.data import cache as cache_module

    monkeypatch.setattr(cache_module.EntryWriter, "write", lambda *a: pytest.fail("retried"))
    assert build(spec, tmp_path / "cache", limit=64).source == "tokenized"


@pytest.mark.parametrize(
    ("limit", "used", "free", "budget"),
    [(None, 0, 500, 500), (1000, 300, 5000, 700), (1000, 300, 200, 200), (1000, 1200, 50, 0)],
    ids=["no-limit-free-space", "limit-less-used", "free-space-smaller", "over-already"],
)
def test_budget(limit: int | None, used: int, free: int, budget: int) -> None:
    assert budget_for(limit, used, free) == budget


def _rank_build(cache: str, corpus: str, out: Any) -> None:
    ds = build(DatasetSpec(uri=corpus), Path(cache))
    out.put((ds.source, np.asarray(ds.blocks).tobytes()))


def test_two_local_ranks_build_once_and_share_it(corpus: Path, tmp_path: Path) -> None:
    """Two processes of one pod starting together: one builds while the other waits on the
    entry's lock, then maps what was built."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_rank_build, args=(str(tmp_path / "c"), str(corpus), out))
             for _ in range(2)]  # fmt: skip
    for p in ranks:
        p.start()
    results = [out.get(timeout=120) for _ in ranks]
    for p in ranks:
        p.join(30)
        assert p.exitcode == 0
    assert sorted(source for source, _ in results) == ["cache built", "cache hit"]
    assert (
        results[0][1] == results[1][1] == build(DatasetSpec(uri=str(corpus)), None).blocks.tobytes()
    )


def test_runtime_env_and_startup_line() -> None:
    env = RuntimeEnv.from_environ({"FT_DATA_CACHE_DIR": "/c", "FT_DATA_CACHE_LIMIT_BYTES": "99"})
    assert (env.data_cache_dir, env.data_cache_limit_bytes) == (Path("/c"), 99)
    assert RuntimeEnv.from_environ({}).data_cache_dir is None
    clock = StartupClock(started_at=0.0)
    clock.mark("imports", at=3.0)
    clock.mark("data", at=3.01, note="cache hit")
    assert clock.summary() == "started in 3.01 s: imports 3.00, data 0.01 (cache hit)"


class _Vocab:
    def __init__(self, size: int, largest: int) -> None:
        self.size, self.largest = size, largest

    def __len__(self) -> int:
        return self.size

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "b": self.largest}


@pytest.mark.parametrize(
    ("size", "largest", "dtype"),
    [(259, 258, np.uint16), (65536, 65535, np.uint16), (32000, 70000, np.uint32),
     (128256, 128255, np.uint32)],
    ids=["bytes", "full-16-bit", "id-beyond-length", "llama3"],
)  # fmt: skip
def test_token_width_holds_every_id(size: int, largest: int, dtype: Any) -> None:
    from finetune_trainer.data.blocks import token_dtype

    assert token_dtype(_Vocab(size, largest)) == np.dtype(dtype)  # type: ignore[arg-type]
