"""The start-up barrier (finetune_trainer.startup_barrier): ranks meet after their own
start-up work through the group's store, waiting for peers that progress however slowly,
failing on one that stopped beating (lost) or beats without progress (stuck)."""

from __future__ import annotations

import json
import math
import threading
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.api import ProcessFailure
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler

from finetune_operator.api.training_spec import DatasetSpec
from finetune_trainer.crash import (
    KIND_PEER_LOST,
    crash_report,
    failure_from_process,
    write_round_id,
)
from finetune_trainer.data.dataset import build_dataset
from finetune_trainer.data.records import load_records
from finetune_trainer.distributed import CollectiveTimeoutError
from finetune_trainer.faults import FaultConfig, build_faults
from finetune_trainer.hub_snapshot import HUB_STALL_EXTRA_S, snapshot_bytes
from finetune_trainer.launch import attempt_round
from finetune_trainer.startup_barrier import (
    HUB_SNAPSHOT_ALLOWANCE_S,
    BarrierStore,
    StartupBarrier,
    heartbeat_seconds,
    job_wait_limit,
    round_name,
    wait_limit,
)
from finetune_trainer.startup_beats import (
    Beat,
    PeerView,
    StartupStalledError,
    decode_beat,
    encode_beat,
    observe,
    verdict,
)
from finetune_trainer.startup_progress import (
    PROGRESS,
    Sample,
    StartupProgress,
    directory_bytes,
    stall_limit,
)
from finetune_trainer.tokenizer import build_byte_tokenizer
from tests.trainer.conftest import (
    Proc,
    launch_standalone,
    make_job,
    tail,
    write_job,
)


def test_heartbeat_is_several_beats_within_the_stale_time() -> None:
    assert heartbeat_seconds(600) == 5.0
    assert heartbeat_seconds(2.0) == pytest.approx(0.4)


def test_wait_limit_covers_the_work_a_rank_may_do_while_its_peers_wait() -> None:
    assert wait_limit(600, 0, downloaded=False, hub_snapshot=False) == 660  # + the wait floor
    # 1 GB: a waiter gives up after 60 s + 1000 s without progress, then tokenizes it at 1 MB/s.
    gb = 10**9
    assert wait_limit(600, gb, downloaded=False, hub_snapshot=False) == 600 + 1060 + 1000
    assert wait_limit(600, gb, downloaded=True, hub_snapshot=False) == 600 + 1060 + 1000 + 1
    hub = wait_limit(600, 0, downloaded=False, hub_snapshot=True)
    assert hub == 660 + HUB_SNAPSHOT_ALLOWANCE_S


def test_a_hub_dataset_of_unknown_size_gets_the_hub_allowance() -> None:
    """A hub dataset id has no files to size (0 bytes): without an allowance a replacement
    pod still downloading it past startup + 60 s would be failed as hung, again and again."""
    job = make_job()
    assert 660 < job_wait_limit(job, 600, None) < 661  # the quickstart's builtin corpus: small
    job.spec.dataset.uri, job.spec.dataset.format = "tatsu-lab/alpaca", "hf"
    assert job_wait_limit(job, 600, None) == 660 + HUB_SNAPSHOT_ALLOWANCE_S


def working(count: int, progress: int, phase: str = "data", stall_s: float = 10.0) -> Beat:
    return Beat(count, phase, progress, stall_s)


READY = Beat(0, ready=True)


def test_a_beat_reads_back_as_published() -> None:
    for beat in (working(3, 1234, "hub download of org/model"), working(1, 0, "listing", math.inf)):
        assert decode_beat(encode_beat(beat).encode()) == beat
    assert decode_beat(encode_beat(READY).encode()).ready
    with pytest.raises(ValueError, match="not of this trainer's format"):
        decode_beat(b"17")  # the counter an older trainer added


def test_the_stall_limit_is_the_startup_timeout_plus_what_a_phase_justifies() -> None:
    assert stall_limit(600) == 600
    # A hub file may show no bytes until it is whole: a 5 GB shard at 10 MB/s.
    assert stall_limit(600, HUB_STALL_EXTRA_S) == 600 + 500


def test_observe_tells_a_beat_from_progress() -> None:
    views = [PeerView(None, 0.0, 0.0), PeerView(working(3, 7), 0.0, 0.0),
             PeerView(working(5, 7), 0.0, 0.0), PeerView(working(5, 7), 0.0, 0.0)]  # fmt: skip
    after = observe(views, [working(1, 0), working(4, 7), working(6, 8), working(5, 7)], now=10.0)
    assert [(v.changed_at, v.progressed_at) for v in after] == [
        (10.0, 10.0),  # first seen
        (10.0, 0.0),  # beats, no progress: alive, not moving
        (10.0, 10.0),  # beats and progresses
        (0.0, 0.0),  # unchanged
    ]
    moved = observe([PeerView(working(5, 7, "data"), 0.0, 0.0)], [working(6, 7, "hub")], 10.0)
    assert moved[0].progressed_at == 10.0  # a new phase is progress


@pytest.mark.parametrize(
    ("beats", "changed", "progressed", "now", "expected"),
    [
        ([READY, READY], [0, 0], [0, 0], 999, ("go", None)),
        ([READY, working(40, 9)], [0, 95], [0, 95], 100, ("wait", None)),  # beats, progresses
        # Slow but steady: its progress moved 9 s ago, within its 10 s stall limit, though
        # it has been starting for 100 s, far past the startup timeout.
        ([READY, working(40, 9)], [0, 99], [0, 91], 100, ("wait", None)),
        ([READY, working(40, 9)], [0, 85], [0, 85], 100, ("lost", 1)),  # silent for 15 s > 10
        ([READY, None], [0, 85], [0, 85], 100, ("lost", 1)),  # never beat
        ([READY, working(40, 9)], [0, 99], [0, 88], 100, ("stuck", 1)),  # beats, still 12 s
        ([READY, working(40, 9, stall_s=20)], [0, 99], [0, 88], 100, ("wait", None)),
        ([READY, working(40, 9, stall_s=math.inf)], [0, 99], [0, 0], 100, ("wait", None)),
        ([READY, working(40, 9)], [0, 999], [0, 999], 1001, ("too long", 1)),  # past the limit
        ([working(4, 1), READY, working(40, 9)], [99, 0, 99], [99, 0, 88], 100, ("stuck", 2)),
    ],
    ids=[
        "all-ready",
        "peer-working",
        "peer-slow-but-steady",
        "peer-silent",
        "peer-never-beat",
        "peer-stuck",
        "phase-with-a-longer-limit",
        "phase-not-judged",
        "past-limit",
        "the-stuck-one-named",
    ],
)
def test_verdict(
    beats: list[Beat | None],
    changed: list[float],
    progressed: list[float],
    now: float,
    expected: tuple[str, int | None],
) -> None:
    views = [PeerView(b, c, p) for b, c, p in zip(beats, changed, progressed, strict=True)]
    assert verdict(views, now, started=0.0, stale_after=10.0, limit=1000.0) == expected


def test_peers_give_a_stuck_rank_a_grace_to_end_itself_first() -> None:
    views = [PeerView(READY, 0, 0), PeerView(working(40, 9), 99, 88)]
    assert verdict(views, 100, started=0, stale_after=10, limit=1000, grace=4) == ("wait", None)
    assert verdict(views, 103, started=0, stale_after=10, limit=1000, grace=4) == ("stuck", 1)


def test_progress_samples_its_phase_and_what_the_work_did(tmp_path: Path) -> None:
    progress = StartupProgress()
    progress.advance(3)  # records tokenized
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "file.incomplete").write_bytes(b"x" * 10)  # a partial download
    failing: list[bool] = []

    def probe() -> int:
        if failing:
            raise OSError("the directory went away")
        return directory_bytes(tmp_path)

    with progress.phase("download", probe, extra_s=5.0):
        assert progress.sample() == Sample("download", 13, 5.0)
        failing.append(True)
        assert progress.sample() == Sample("download", 13, 5.0)  # reads as its last value
    assert progress.sample() == Sample("starting", 3, 0.0)
    assert directory_bytes(tmp_path / "absent") == 0


def test_a_hub_download_shows_as_the_bytes_of_its_cache_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub streams a file into `<cache>/models--org--name/blobs/<sha>.incomplete`:
    the download phase's probe counts it while it grows."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    blobs = tmp_path / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "0123.incomplete").write_bytes(b"x" * 5)
    (tmp_path / "models--org--other").mkdir()
    (tmp_path / "models--org--other" / "w").write_bytes(b"x" * 100)  # another repo's
    progress = StartupProgress()
    with progress.phase("hub", lambda: snapshot_bytes("org/tiny")):
        assert progress.sample().progress == 5
        with open(blobs / "0123.incomplete", "ab") as f:
            f.write(b"y" * 7)
        assert progress.sample().progress == 12


def test_a_rank_holding_a_lock_shows_its_progress_to_the_ranks_waiting_on_it(
    tmp_path: Path,
) -> None:
    """The local rank that holds the data cache's key lock may itself be waiting for another
    pod's build: its progress (that build's) reaches the local ranks waiting on the lock as
    the growth of a file in the directory they probe."""
    holder, waiter = StartupProgress(), StartupProgress()
    with waiter.phase("data", lambda: directory_bytes(tmp_path)):
        first = waiter.sample().progress
        with holder.echoed(tmp_path / "key.progress"):
            holder.advance()
            assert waiter.sample().progress > first
            second = waiter.sample().progress
            holder.advance()
            assert waiter.sample().progress > second
        assert not (tmp_path / "key.progress").exists()


def test_tokenizing_and_a_data_delay_are_progress_and_a_stall_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The data phase reports its records; the fault knobs are slow work (progress moving)
    and a hung read (none), on a fake clock."""
    before = PROGRESS.sample().progress
    spec = DatasetSpec(uri="builtin://quickstart")
    build_dataset(spec, build_byte_tokenizer(), 128)
    records = len(list(load_records(spec).rows()))
    assert records and PROGRESS.sample().progress - before == records  # each one tokenized
    now = [0.0]
    seen: list[tuple[float, Sample]] = []

    def sleep(seconds: float) -> None:  # what the barrier would see as each sleep starts
        seen.append((seconds, PROGRESS.sample()))
        now[0] += seconds

    clock = SimpleNamespace(monotonic=lambda: now[0], sleep=sleep)
    monkeypatch.setattr("finetune_trainer.faults.time", clock)
    env = {"FT_DATA_DELAY_SECONDS": "2", "FT_DATA_STALL_SECONDS": "60", "FT_DATA_DELAY_RANK": "1"}
    build_faults(FaultConfig.from_environ(env), rank=1).after_data()
    *slow, (stall_s, stalled) = seen
    assert len(slow) >= 19 and [p.progress for _, p in slow] == sorted(
        {p.progress for _, p in slow}
    )
    assert stall_s == 60 and now[0] == pytest.approx(62.0)  # the hung read
    assert PROGRESS.sample().progress == stalled.progress  # no progress through it
    assert {sample.phase for _, sample in seen} == {"data"}


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)


def client(server: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))


class Rank(StartupBarrier):
    """A rank's barrier with a progress of its own, advanced by a thread every 50 ms while it
    starts (`working`), and its stuck verdict recorded in `ended` (the real one ends the
    process)."""

    def __init__(
        self, store: BarrierStore, rank: int, world: int, stale_after: float, *,
        round_id: int = 0, working: bool = True,
    ) -> None:  # fmt: skip
        self.ended: list[StartupStalledError] = []
        super().__init__(store, rank, world, stale_after, round_id=round_id,
                         progress=StartupProgress(), on_stuck=self.ended.append)  # fmt: skip
        if working:
            threading.Thread(target=self._work, daemon=True).start()

    def _work(self) -> None:
        while not self._stop.wait(0.05):
            self.progress.advance()


def test_a_rank_waits_past_the_stall_limit_for_a_peer_that_progresses(store: TCPStore) -> None:
    """Rank 1 works three times the stale time and the stall limit (beating, progressing);
    rank 0 waits for it and both go."""
    early = Rank(store, 0, 2, stale_after=0.5).start()
    late = Rank(client(store), 1, 2, stale_after=0.5).start()
    waited: list[float] = []
    t = threading.Thread(target=lambda: waited.append(early.arrive(limit=30.0)))
    t.start()
    threading.Event().wait(1.5)  # rank 1's own start-up work
    assert t.is_alive()
    late.arrive(limit=30.0)
    t.join(10)
    assert waited and waited[0] > 1.4


def test_a_restarted_round_on_the_same_store_waits_again(store: TCPStore) -> None:
    """A hand-run torchrun's static rendezvous keeps one store for every restart: the
    previous round's ready count must not let the next round's first rank through."""
    first = [Rank(s, r, 2, stale_after=5.0).start() for r, s in ((0, store), (1, client(store)))]
    done = threading.Thread(target=first[1].arrive, args=(30.0,))
    done.start()
    first[0].arrive(limit=30.0)
    done.join(10)
    early = Rank(store, 0, 2, stale_after=5.0, round_id=1).start()
    late = Rank(client(store), 1, 2, stale_after=5.0, round_id=1).start()
    waited: list[float] = []
    t = threading.Thread(target=lambda: waited.append(early.arrive(limit=30.0)))
    t.start()
    threading.Event().wait(0.5)  # rank 1 still starting
    assert t.is_alive(), "rank 0 went on with the previous round's count"
    late.arrive(limit=30.0)
    t.join(10)
    assert waited and waited[0] > 0.4


def test_the_ranks_of_a_round_agree_on_its_id_and_the_next_round_has_another(
    store: TCPStore, tmp_path: Path
) -> None:
    """Rank 1 asks before rank 0 has made the id (its get waits for it); both get the same
    one, left next to each rank's error file for the launcher (crash.write_round_id); the
    next round's id differs: a failure is counted once per round (reconcile/budget.py)."""
    ids: list[str] = []
    waiter = StartupBarrier(client(store), 1, 2, stale_after=5.0)
    t = threading.Thread(target=lambda: ids.append(waiter.agree_round_id()))
    t.start()
    threading.Event().wait(0.2)
    assert t.is_alive()  # waits for rank 0's id
    ids.insert(0, StartupBarrier(store, 0, 2, stale_after=5.0).agree_round_id())
    t.join(10)
    assert len(ids) == 2 and ids[0] == ids[1] and ids[0]
    for rank, round_id in enumerate(ids):
        assert write_round_id(round_id, str(tmp_path / "attempt_0" / str(rank) / "error.json"))
    assert attempt_round(tmp_path / "attempt_0") == ids[0]
    following = StartupBarrier(store, 0, 2, stale_after=5.0, round_id=1).agree_round_id()
    assert following != ids[0]


class CountingStore:
    """A store that counts the requests it is sent."""

    def __init__(self, store: TCPStore) -> None:
        self.store, self.requests = store, 0

    def add(self, key: str, value: int) -> int:
        self.requests += 1
        return self.store.add(key, value)

    def set(self, key: str, value: str) -> None:
        self.requests += 1
        self.store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        self.requests += 1
        return self.store.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.requests += 1
        return self.store.multi_get(keys)


def test_a_rank_that_never_beat_costs_a_request_per_read_not_one_per_rank(
    store: TCPStore,
) -> None:
    """64 ranks, rank 63 lost before its first beat: after its first, a waiter's read of the
    beats is a few requests to rank 0's store, not two per rank (every waiter reads once per
    heartbeat until the lost rank is declared, the startup timeout: minutes)."""
    world = 64
    for rank in range(1, world - 1):
        store.set(f"ft-startup/0/beat/{rank}", encode_beat(working(1, 0)))
    counting = CountingStore(store)
    waiter = Rank(counting, 0, world, stale_after=5.0).start()
    waiter._stop_beating()
    counting.requests = 0
    beats = waiter._beats()
    assert beats[1:3] == [working(1, 0), working(1, 0)] and beats[-1] is None
    assert counting.requests <= world + 2  # the first read finds who has beaten
    counting.requests = 0
    assert waiter._beats() == beats
    assert counting.requests <= 3  # then: the missing key looked for, the others read in one


def test_a_probe_that_raises_does_not_stop_the_beat(store: TCPStore) -> None:
    """A phase's probe failing with something other than an OSError (an import missing, a
    helper renamed) reads as no progress from the probe; it must not end the beat thread,
    or the peers would fail a rank that works, as lost, after the stale time."""

    def broken() -> int:
        raise ImportError("cannot import name 'repo_folder_name'")

    early = Rank(store, 0, 2, stale_after=0.5).start()
    late = Rank(client(store), 1, 2, stale_after=0.5).start()
    with late.progress.phase("hub download", broken):  # its beat thread samples it
        waited: list[float] = []
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                waited.append(early.arrive(limit=30.0))
            except CollectiveTimeoutError as e:
                failed.append(e)

        t = threading.Thread(target=wait)
        t.start()
        threading.Event().wait(1.2)  # over twice the stale time, progressing by `advance`
        assert not failed, failed
        late.arrive(limit=30.0)
    t.join(10)
    assert waited and not failed and not late.ended


def test_a_peer_that_stops_beating_is_a_lost_peer(store: TCPStore) -> None:
    early = Rank(store, 0, 2, stale_after=0.5).start()
    dead = Rank(client(store), 1, 2, stale_after=0.5).start()
    dead._stop_beating()  # its process frozen or its node gone: no beat, no arrival
    with pytest.raises(CollectiveTimeoutError, match="rank 1 stopped beating"):
        early.arrive(limit=30.0)


@pytest.mark.parametrize("limit", [30.0, 0.2], ids=["peer-silent", "peer-past-the-limit"])
def test_a_barrier_failure_is_reported_as_a_lost_peer(
    store: TCPStore, tmp_path: Path, limit: float
) -> None:
    """The waiting ranks only lost a peer: their crash report says so (the operator looks for
    the root cause in the lost pod's report, never theirs), as for a collective's timeout."""
    early = Rank(store, 0, 2, stale_after=0.5).start()
    peer = Rank(client(store), 1, 2, stale_after=0.5).start()
    if limit > 1:
        peer._stop_beating()
    path = tmp_path / "error.json"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        try:
            early.arrive(limit=limit)
        except CollectiveTimeoutError as e:
            ErrorHandler().record_exception(e)
    peer._stop_beating()
    failed = ChildFailedError("trainer", {0: ProcessFailure(0, 3, 1, str(path))})
    report = crash_report([failure_from_process(r, f) for r, f in failed.failures.items()])
    assert report["crash"]["kind"] == KIND_PEER_LOST, report


def test_a_peer_alive_but_starting_past_the_limit_fails_the_wait(store: TCPStore) -> None:
    early = Rank(store, 0, 2, stale_after=0.5).start()
    slow = Rank(client(store), 1, 2, stale_after=0.5).start()  # progresses, never arrives
    with pytest.raises(CollectiveTimeoutError, match="rank 1 was still starting"):
        early.arrive(limit=1.0)
    slow._stop_beating()
    assert not slow.ended


def test_a_peer_that_beats_without_progress_is_stuck_and_ends_itself(store: TCPStore) -> None:
    """Rank 1 beats (its thread runs) but its work stands still: it ends itself (its own
    failure, naming its phase and where its main thread is) and rank 0 fails as for a lost
    peer, naming it, its phase and its last progress, well before `limit`."""
    early = Rank(store, 0, 2, stale_after=0.5).start()
    stuck = Rank(client(store), 1, 2, stale_after=0.5, working=False)
    stuck.progress.advance(41)
    with stuck.progress.phase("dataset download"):
        stuck.start()
        with pytest.raises(CollectiveTimeoutError) as failed:
            early.arrive(limit=30.0)
    message = str(failed.value)
    assert message.startswith("rank 1 made no start-up progress for "), message
    assert (
        "in phase 'dataset download' (last progress count 41; it beats, so it is alive "
        "but stuck" in message
    )
    assert len(stuck.ended) == 1, "the stuck rank did not end itself"
    own = str(stuck.ended[0])
    assert "rank 1 made no start-up progress" in own and "'dataset download'" in own
    assert "main thread at " in own and "in arrive" in own  # here: this test's, waiting


def log_time(text: str, marker: str) -> datetime:
    """When the first log line holding `marker` was written (the trainer's asctime)."""
    line = next(line for line in text.splitlines() if marker in line)
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


@pytest.mark.slow
def test_a_slow_rank_is_waited_for_and_a_stuck_one_ends_itself(
    tmp_path: Path, procs: list[Proc]
) -> None:
    """Real torchrun, gloo, a 10 s startup collective timeout (the stall limit). Rank 1's
    data phase progresses for 11 s, past the startup timeout and the stall limit: rank 0
    waits for it at the barrier (before the barrier it timed out in DDP's first broadcast).
    Then rank 1 stands still, beating (a hung read): it ends itself about 10 s later, and
    the termination log names it, its phase and the cause, not a lost peer. Before, a rank
    stuck like that held its peers until wait_limit (over 11 minutes here)."""
    job = make_job()
    job.spec.fault_tolerance.startup_collective_timeout_seconds = 10
    job.spec.fault_tolerance.collective_timeout_seconds = 10
    report = tmp_path / "termination-log"
    report.write_text("")
    p = launch_standalone(write_job(tmp_path / "job.json", job), cwd=tmp_path,
                          log=tmp_path / "run.log", procs=procs, FT_TERMINATION_LOG=str(report),
                          FT_DATA_DELAY_SECONDS="11", FT_DATA_DELAY_RANK="1",
                          FT_DATA_STALL_SECONDS="300")  # fmt: skip
    assert p.wait(120) == 1, tail(p.log)
    crash = json.loads(report.read_text())["crash"]
    assert crash["rank"] == 1 and crash["kind"] == "Exception", crash
    assert crash["exception"].endswith("StartupStalledError"), crash
    assert "rank 1 made no start-up progress for 10s in phase 'data'" in crash["message"], crash
    text = p.log.read_text(errors="replace")
    # Slow is not stuck: rank 0 waited through rank 1's 11 s of slow progress (a stall limit
    # judged by time alone would have failed it after 10) and its 10 s without any.
    waiting = log_time(text, "waiting for rank(s) 1 to finish starting")
    ended = log_time(text, "rank1 ERROR finetune_trainer.startup_barrier: start-up: rank 1 made")
    assert (ended - waiting).total_seconds() > 18, tail(p.log)


def test_ranks_of_one_round_that_count_restarts_differently_meet(store: TCPStore) -> None:
    """A replacement pod's agent starts at restart count 0 while the survivors' agents counted
    the failure that lost its predecessor: on a store of its own per round (the worker pod's
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) they are one round and must meet."""
    survivor = round_name(1, agent_store=False)
    replacement = round_name(0, agent_store=False)
    early = Rank(store, 0, 2, stale_after=5.0, round_id=survivor).start()
    late = Rank(client(store), 1, 2, stale_after=5.0, round_id=replacement).start()
    done = threading.Thread(target=late.arrive, args=(30.0,))
    done.start()
    early.arrive(limit=10.0)  # a CollectiveTimeoutError here: the ranks never saw each other
    done.join(10)
    assert not done.is_alive()
    # On the agent's store, shared by every round, the count names the round.
    assert round_name(2, agent_store=True) == 2
