"""The pods of a fresh job elect one builder of the data cache's entry through the shared copy
(finetune_trainer.data.build_claim): the others wait and copy it; a dead builder's claim is
taken over; a wait is bounded; a corpus too big to cache is not waited for."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from finetune_operator.api.spec import CheckpointSpec, DatasetSpec
from finetune_trainer.data import CacheSettings, build_dataset
from finetune_trainer.data.build_claim import (
    STALE_AFTER_S,
    WAIT_FLOOR_S,
    BuildClaim,
    Election,
    built_bytes,
    create_exclusive,
    holder_gone,
    incarnation,
    is_stale,
    next_step,
    skips,
    wait_bound,
)
from finetune_trainer.data.cache_entry import open_entry
from finetune_trainer.data.shared import SHARED_DIR, SharedCache, shared_cache_for
from finetune_trainer.location import Location
from finetune_trainer.startup_progress import PROGRESS
from finetune_trainer.tokenizer import build_byte_tokenizer
from tests.objectstore import MotoServer
from tests.trainer.test_data_cache import SEQ, write_corpus

OWNER = {"job": "quickstart", "namespace": "default", "uid": "uid-1"}


# ---- pure decisions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "step"),
    [
        ({"entry_whole": True, "claimed": True}, "fetch"),
        ({"skipped": True, "claimed": True}, "skip"),
        ({}, "claim"),  # nobody builds it: this pod does
        ({"saw_claim": True}, "give up"),  # the builder left without publishing
        ({"claimed": True}, "wait"),
        ({"claimed": True, "last_change": 0.0, "now": STALE_AFTER_S + 1}, "take over"),
        ({"claimed": True, "holder_gone": True}, "take over"),
        ({"claimed": True, "last_change": 500.0, "now": 501.0, "bound": 400.0}, "give up"),
    ],
)
def test_next_step(state: dict[str, Any], step: str) -> None:
    args: dict[str, Any] = {
        "entry_whole": False,
        "skipped": False,
        "claimed": False,
        "saw_claim": False,
        "last_change": 10.0,
        "started": 0.0,
        "now": 20.0,
        "bound": 300.0,
    }
    assert next_step(**(args | state)) == step


@pytest.mark.parametrize(("age", "stale"), [(0.0, False), (STALE_AFTER_S, False), (STALE_AFTER_S + 0.1, True)])  # fmt: skip
def test_is_stale(age: float, stale: bool) -> None:
    assert is_stale(100.0, 100.0 + age) is stale


def test_wait_bound_grows_with_the_corpus_and_stays_under_the_limit() -> None:
    assert wait_bound(None, None) == WAIT_FLOOR_S
    assert wait_bound(10**9, None) > wait_bound(10**8, None) > WAIT_FLOOR_S
    assert wait_bound(10**9, 300.0) == 300.0
    assert wait_bound(0, 30.0) == 30.0


# ---- the election on real files, with a clock of its own -----------------------------------


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def election(root: Path, t: FakeTime) -> Election:
    return Election(
        _local(root),
        "k" * 32,
        heartbeat_s=3600,
        stale_after_s=30.0,
        poll_s=1.0,
        clock=t.clock,
        sleep=t.sleep,
    )


def _local(root: Path) -> Location:
    made = shared_cache_for(CheckpointSpec(uri=str(root)), None, OWNER)
    assert made is not None
    made.root.makedirs()
    return made.root


def test_a_claim_that_stops_changing_is_taken_over(tmp_path: Path) -> None:
    t = FakeTime()
    e = election(tmp_path, t)
    e.claim_path.write_atomic(json.dumps({"holder": "dead-1", "beat": 3}).encode())
    turn = e.run(lambda: False, lambda: None, bound=1000.0)
    assert turn.claim is not None and 30.0 < t.now < 35.0
    assert json.loads(e.claim_path.read_bytes())["holder"] == turn.claim.holder
    turn.claim.release()
    assert not e.claim_path.exists()


def test_the_heartbeat_renews_the_claim_and_leaves_a_takers_claim_alone(tmp_path: Path) -> None:
    e = election(tmp_path, FakeTime())
    e.heartbeat_s = 0.02
    claim = e.try_claim()
    assert claim is not None and e.try_claim() is None  # exclusive
    deadline = time.monotonic() + 30
    while json.loads(e.claim_path.read_bytes())["beat"] < 2:  # the thread rewrites it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    taker = json.dumps({"holder": "another-pod-1", "beat": 0}).encode()
    e.claim_path.write_atomic(taker)  # a waiter took it over while this pod stalled
    time.sleep(0.2)
    claim.release()
    assert e.claim_path.read_bytes() == taker  # neither renewed over nor removed


def test_a_claim_of_a_dead_process_of_this_pod_is_taken_over_at_once(tmp_path: Path) -> None:
    """A worker restarted by torchelastic mid-build finds its predecessor's claim."""
    dead = multiprocessing.get_context("fork").Process(target=int)
    dead.start()
    dead.join()
    t = FakeTime()
    e = election(tmp_path, t)
    holder = f"{socket.gethostname()}-{dead.pid}"
    e.claim_path.write_atomic(json.dumps({"holder": holder, "beat": 3}).encode())
    turn = e.run(lambda: False, lambda: None, bound=1000.0)
    assert turn.claim is not None and t.now == 0.0
    turn.claim.release()
    alive = f"{socket.gethostname()}-{os.getppid()}"  # ours, alive: judged by its heartbeat
    assert not holder_gone(json.dumps({"holder": alive}).encode())
    assert not holder_gone(json.dumps({"holder": f"another-pod-{dead.pid}"}).encode())


def test_a_replaced_pods_claim_is_taken_over_at_once_though_its_pid_is_reused(
    tmp_path: Path,
) -> None:
    """The operator's pods keep their names: a pod evicted mid-build comes back with the
    same host name, and its worker (a fresh PID namespace) often with the dead one's pid, or
    that pid now another live process's. Neither is the builder: no 120 s wait."""
    t = FakeTime()
    e = election(tmp_path, t)
    mine = f"{socket.gethostname()}-{os.getpid()}"
    e.claim_path.write_atomic(json.dumps({"holder": mine, "beat": 7}).encode())
    turn = e.run(lambda: False, lambda: None, bound=1000.0)
    assert turn.claim is not None and t.now == 0.0
    turn.claim.release()
    parent = os.getppid()  # alive: judged by which process holds that pid now
    holder = f"{socket.gethostname()}-{parent}"
    now_there = incarnation(parent)
    assert now_there is not None
    assert holder_gone(json.dumps({"holder": holder, "incarnation": "old-boot:1"}).encode())
    assert not holder_gone(json.dumps({"holder": holder, "incarnation": now_there}).encode())
    assert BuildClaim(e.claim_path, e.skip_path, 3600).incarnation == incarnation(os.getpid())


def test_a_claim_that_keeps_changing_is_waited_for_up_to_the_bound(tmp_path: Path) -> None:
    t = FakeTime()
    e = election(tmp_path, t)

    def beating(seconds: float) -> None:  # the builder's heartbeat, as the waiter sees it
        t.sleep(seconds)
        e.claim_path.write_atomic(json.dumps({"holder": "alive", "beat": t.now}).encode())

    e.sleep = beating
    beating(0)
    turn = e.run(lambda: False, lambda: None, bound=100.0)
    assert turn.claim is None and turn.found is None and not turn.skip  # builds, unelected
    assert 100.0 < t.now < 103.0
    assert json.loads(e.claim_path.read_bytes())["holder"] == "alive"  # not taken from it


def test_a_build_that_advances_is_waited_for_past_the_bound(tmp_path: Path) -> None:
    """Giving up on a builder that advances costs a whole build and arrives later at the
    first collective than waiting would: the bound runs from the build's last progress."""
    t = FakeTime()
    e = election(tmp_path, t)
    built = {"bytes": 0, "stops_at": 250.0}

    def building(seconds: float) -> None:  # the heartbeat reports the bytes written so far
        t.sleep(seconds)
        if t.now < built["stops_at"]:
            built["bytes"] += 1
        beat = {"holder": "alive", "beat": t.now, "built_bytes": built["bytes"]}
        e.claim_path.write_atomic(json.dumps(beat).encode())

    e.sleep = building
    building(0)
    before = PROGRESS.sample().progress
    published = e.run(lambda: t.now >= 200.0, lambda: "the entry", bound=100.0)
    assert published.found == "the entry" and 200.0 <= t.now < 203.0  # not given up at 100
    # The builder's progress is the waiting rank's, at the start-up barrier (not stuck).
    assert PROGRESS.sample().progress - before >= 90  # a poll every 2 s, each saw it advance
    # The builder stops advancing at 250 s (its heartbeat goes on): given up 100 s later.
    turn = e.run(lambda: False, lambda: None, bound=100.0)
    assert turn.claim is None and turn.found is None and 350.0 < t.now < 353.0
    assert BuildClaim(e.claim_path, e.skip_path, 3600).content().find(b"built_bytes") == -1
    claim = BuildClaim(e.claim_path, e.skip_path, 3600)
    claim.progress = lambda: 42
    assert built_bytes(claim.content()) == 42


def test_a_published_entry_is_fetched_and_a_skip_marker_not_waited_for(tmp_path: Path) -> None:
    t = FakeTime()
    e = election(tmp_path, t)
    e.claim_path.write_atomic(b'{"holder": "builder"}')
    published = {"at": 5.0}
    turn = e.run(lambda: t.now >= published["at"], lambda: "the entry", bound=100.0)
    assert turn.found == "the entry" and 5.0 <= t.now < 7.0
    BuildClaim(e.claim_path, e.skip_path, 3600).mark_skipped("over the cacheSizeLimit")
    t.now = 0.0
    assert e.run(lambda: False, lambda: None, bound=100.0).skip and t.now == 0.0


def test_a_skip_marker_binds_only_pods_with_no_more_room(tmp_path: Path) -> None:
    """The builder's budget was its own (its node's free space, its other entries): a pod
    with more room builds the entry rather than going without a cache for the job's life."""
    assert not skips(None, 10)
    assert skips(b"over 10 bytes", 10**9)  # a marker that does not say: skip
    marker = json.dumps({"reason": "over 1000 bytes", "over_bytes": 1000}).encode()
    assert skips(marker, 1000) and skips(marker, 10) and skips(marker, None)
    assert not skips(marker, 5000)
    t = FakeTime()
    e = election(tmp_path, t)
    BuildClaim(e.claim_path, e.skip_path, 3600).mark_skipped("over 1000 bytes", 1000)
    assert e.run(lambda: False, lambda: None, bound=100.0, budget=800).skip
    roomier = e.run(lambda: False, lambda: None, bound=100.0, budget=5000)
    assert not roomier.skip and roomier.claim is not None  # elected: it builds
    roomier.claim.release()


def test_a_claim_replaced_while_read_over_nfs_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS answers ESTALE when the builder's heartbeat renamed a new claim over the file this
    pod had opened: the poll reads it again rather than abandoning the election."""
    t = FakeTime()
    e = election(tmp_path, t)
    e.claim_path.write_atomic(b'{"holder": "builder"}')
    read = Location.read_bytes
    stale = {"left": 2}

    def replaced_meanwhile(self: Location) -> bytes:
        if self == e.claim_path and stale["left"]:
            stale["left"] -= 1
            raise OSError(errno.ESTALE, "Stale file handle")
        return read(self)

    monkeypatch.setattr(Location, "read_bytes", replaced_meanwhile)
    turn = e.run(lambda: t.now >= 3.0, lambda: "the entry", bound=100.0)
    assert turn.found == "the entry" and stale["left"] == 0


def test_a_builder_gone_without_publishing_leaves_each_pod_to_build(tmp_path: Path) -> None:
    t = FakeTime()
    e = election(tmp_path, t)
    e.claim_path.write_atomic(b'{"holder": "builder"}')

    def builder_fails(seconds: float) -> None:
        t.sleep(seconds)
        e.claim_path.remove()

    e.sleep = builder_fails
    turn = e.run(lambda: False, lambda: None, bound=100.0)
    assert turn.claim is None and turn.found is None and not e.claim_path.exists()


def test_blocks_too_big_to_cache_are_marked_and_not_waited_for(tmp_path: Path) -> None:
    """The elected builder finds the blocks over the cache's limit: it leaves `.skip` in the
    shared copy and releases its claim; the next pod tokenizes at once, claiming nothing."""
    corpus = write_corpus(tmp_path / "data.jsonl", rows=300)
    made = shared_cache_for(CheckpointSpec(uri=str(tmp_path / "ckpt")), None, OWNER)
    assert made is not None
    spec, tok = DatasetSpec(uri=str(corpus)), build_byte_tokenizer()
    settings = CacheSettings(tmp_path / "node-a", 1024, made)
    assert build_dataset(spec, tok, SEQ, settings).source == "tokenized"
    names = os.listdir(tmp_path / "ckpt" / SHARED_DIR)
    assert [n for n in names if n.endswith(".skip")] and not [
        n for n in names if n.endswith(".building")
    ]
    data = build_dataset(spec, tok, SEQ, CacheSettings(tmp_path / "node-b", 1024, made))
    assert data.source == "tokenized"
    (skip,) = (tmp_path / "node-b").glob("*.skip")  # from the marker, not a build of its own
    assert skip.read_text() == "too big (another pod found)"
    assert sorted(os.listdir(tmp_path / "ckpt" / SHARED_DIR)) == sorted(names)
    # A node with room for them (no limit) builds and caches them: the marker was node-a's.
    roomy = build_dataset(spec, tok, SEQ, CacheSettings(tmp_path / "node-c", None, made))
    assert roomy.source == "cache built"
    assert not list((tmp_path / "node-c").glob("*.skip"))


def test_the_claim_is_exclusive_on_object_storage(s3_credentials: MotoServer) -> None:
    """A conditional PUT (If-None-Match: *) through the trainer's s3fs client."""
    uri = f"s3://{s3_credentials.new_bucket()}/ckpt/job"
    shared = shared_cache_for(CheckpointSpec(uri=uri), s3_credentials.spec(), OWNER)
    assert shared is not None
    e = shared.election("k" * 32)
    assert create_exclusive(e.claim_path, b"first")
    assert not create_exclusive(e.claim_path, b"second")
    assert e.claim_path.read_bytes() == b"first"
    claim = e.try_claim()
    assert claim is None
    e.claim_path.remove()
    claim = e.try_claim()
    assert claim is not None
    claim.release()
    assert not e.claim_path.exists()


# ---- real pods: forked processes sharing a directory as the checkpoint storage ------------


def _pod(
    ckpt: str, corpus: str, local: str, stall: float, go: Any, tokenizing: Any, out: Any
) -> None:
    """One pod's data phase: its own cache directory, the shared checkpoint directory. The
    tokenizer is the real one; `stall` seconds are added to its first call (a slow corpus),
    and `tokenizing` is set when it is called at all. Each pod has a host name of its own,
    as pods on different nodes do."""
    socket.gethostname = lambda: Path(local).name
    tok = build_byte_tokenizer()
    tokenize = type(tok).__call__
    calls = {"n": 0}

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        tokenizing.set()
        if calls["n"] == 1:
            time.sleep(stall)
        return tokenize(self, *args, **kwargs)

    type(tok).__call__ = counted  # type: ignore[method-assign]
    made = shared_cache_for(CheckpointSpec(uri=ckpt), None, OWNER)
    assert made is not None
    shared = SharedCache(made.root, made.claim, heartbeat_s=0.2, stale_after_s=2.0, poll_s=0.1)
    go.wait()
    data = build_dataset(
        DatasetSpec(uri=corpus), tok, SEQ, CacheSettings(Path(local), None, shared)
    )
    out.put((data.source, calls["n"], np.asarray(data.blocks).tolist()))


def _start(ctx: Any, tmp: Path, name: str, stall: float, go: Any, out: Any) -> tuple[Any, Any]:
    tokenizing = ctx.Event()
    args = (str(tmp / "ckpt"), str(tmp / "data.jsonl"), str(tmp / name), stall, go, tokenizing, out)
    proc = ctx.Process(target=_pod, args=args)
    proc.start()
    return proc, tokenizing


@pytest.mark.slow
def test_pods_starting_together_tokenize_once_and_a_dead_builder_is_taken_over(
    tmp_path: Path,
) -> None:
    write_corpus(tmp_path / "data.jsonl", rows=400)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    # A fresh job: two pods at once; the builder's tokenizing takes a second.
    go = ctx.Barrier(2)
    pods = [_start(ctx, tmp_path, f"node-{i}", 1.0, go, out)[0] for i in range(2)]
    results = sorted(out.get(timeout=120) for _ in pods)
    for p in pods:
        p.join(30)
        assert p.exitcode == 0
    (built, built_calls, built_blocks), (hit, hit_calls, hit_blocks) = results
    assert (built, hit) == ("cache built", "cache shared hit")
    assert built_calls > 0 and hit_calls == 0  # the other pod copied it, never tokenized
    assert hit_blocks == built_blocks
    shared = tmp_path / "ckpt" / SHARED_DIR
    (key,) = os.listdir(shared)  # the claim is gone, one entry remains
    assert open_entry(shared / key, key) is not None

    # Again with new data: the builder's pod dies mid-build (SIGKILL: no clean-up, a claim
    # left behind); the waiting pod takes its claim over once its heartbeat stops.
    write_corpus(tmp_path / "data.jsonl", rows=300, seed=1)
    go = ctx.Barrier(1)
    builder, building = _start(ctx, tmp_path, "node-2", 3600.0, go, out)
    assert building.wait(60)
    (claim,) = [n for n in os.listdir(shared) if n.endswith(".building")]
    waiter, _ = _start(ctx, tmp_path, "node-3", 0.0, ctx.Barrier(1), out)
    time.sleep(1.0)  # the waiter has found the live claim
    assert json.loads((shared / claim).read_bytes())["beat"] >= 1  # heartbeaten while building
    os.kill(builder.pid, signal.SIGKILL)
    builder.join(30)
    source, calls, blocks = out.get(timeout=120)
    waiter.join(30)
    assert waiter.exitcode == 0
    assert source == "cache built" and calls > 0
    names = os.listdir(shared)
    assert claim not in names and len(names) == 1  # published; the old entry pruned
    published = open_entry(shared / names[0], names[0])
    assert published is not None and np.array_equal(np.asarray(blocks), published.blocks)
