"""The start-up barrier (finetune_trainer.startup_barrier): ranks meet after their own
start-up work through the group's store, waiting for peers that are alive however long they
take, failing on one that stopped beating."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.api import ProcessFailure
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler

from finetune_trainer.crash import (
    KIND_PEER_LOST,
    crash_report,
    failure_from_process,
    write_round_id,
)
from finetune_trainer.distributed import CollectiveTimeoutError
from finetune_trainer.launch import attempt_round
from finetune_trainer.startup_barrier import (
    HUB_SNAPSHOT_ALLOWANCE_S,
    READY_MARK,
    PeerView,
    StartupBarrier,
    heartbeat_seconds,
    job_wait_limit,
    observe,
    round_name,
    verdict,
    wait_limit,
)
from tests.trainer.conftest import (
    Proc,
    launch_standalone,
    make_job,
    step_lines,
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


def test_observe_records_when_each_beat_last_changed() -> None:
    views = [PeerView(None, 0.0), PeerView(3, 0.0), PeerView(5, 0.0)]
    after = observe(views, [1, 3, 6], now=10.0)
    assert after == [PeerView(1, 10.0), PeerView(3, 0.0), PeerView(6, 10.0)]


@pytest.mark.parametrize(
    ("beats", "changed", "now", "expected"),
    [
        ([READY_MARK, READY_MARK + 7], [0, 0], 999, ("go", None)),
        ([READY_MARK, 40], [0, 95], 100, ("wait", None)),  # rank 1 beats: alive, working
        ([READY_MARK, 40], [0, 85], 100, ("lost", 1)),  # silent for 15 s > 10
        ([READY_MARK, None], [0, 85], 100, ("lost", 1)),  # never beat
        ([READY_MARK, 40], [0, 999], 1001, ("too long", 1)),  # alive, past the limit
    ],
    ids=["all-ready", "peer-working", "peer-silent", "peer-never-beat", "past-limit"],
)
def test_verdict(
    beats: list[int | None], changed: list[float], now: float, expected: tuple[str, int | None]
) -> None:
    views = [PeerView(b, c) for b, c in zip(beats, changed, strict=True)]
    assert verdict(views, now, started=0.0, stale_after=10.0, limit=1000.0) == expected


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)


def client(server: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))


def test_a_rank_waits_past_the_stale_time_for_a_peer_that_beats(store: TCPStore) -> None:
    """Rank 1 works three times the stale time (beating); rank 0 waits for it and both go."""
    early = StartupBarrier(store, 0, 2, stale_after=0.5).start()
    late = StartupBarrier(client(store), 1, 2, stale_after=0.5).start()
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
    first = [
        StartupBarrier(s, r, 2, stale_after=5.0).start()
        for r, s in ((0, store), (1, client(store)))
    ]
    done = threading.Thread(target=first[1].arrive, args=(30.0,))
    done.start()
    first[0].arrive(limit=30.0)
    done.join(10)
    early = StartupBarrier(store, 0, 2, stale_after=5.0, round_id=1).start()
    late = StartupBarrier(client(store), 1, 2, stale_after=5.0, round_id=1).start()
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
        store.add(f"ft-startup/0/beat/{rank}", 1)
    counting = CountingStore(store)
    waiter = StartupBarrier(counting, 0, world, stale_after=5.0).start()
    waiter._stop_beating()
    counting.requests = 0
    beats = waiter._beats()
    assert beats[:3] == [1, 1, 1] and beats[-1] is None
    assert counting.requests <= world + 2  # the first read finds who has beaten
    counting.requests = 0
    assert waiter._beats() == beats
    assert counting.requests <= 3  # then: the missing key looked for, the others read in one


def test_a_peer_that_stops_beating_is_a_lost_peer(store: TCPStore) -> None:
    early = StartupBarrier(store, 0, 2, stale_after=0.5).start()
    dead = StartupBarrier(client(store), 1, 2, stale_after=0.5).start()
    dead._stop_beating()  # its process frozen or its node gone: no beat, no arrival
    with pytest.raises(CollectiveTimeoutError, match="rank 1 stopped beating"):
        early.arrive(limit=30.0)


@pytest.mark.parametrize("limit", [30.0, 0.2], ids=["peer-silent", "peer-past-the-limit"])
def test_a_barrier_failure_is_reported_as_a_lost_peer(
    store: TCPStore, tmp_path: Path, limit: float
) -> None:
    """The waiting ranks only lost a peer: their crash report says so (the operator looks for
    the root cause in the lost pod's report, never theirs), as for a collective's timeout."""
    early = StartupBarrier(store, 0, 2, stale_after=0.5).start()
    peer = StartupBarrier(client(store), 1, 2, stale_after=0.5).start()
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
    early = StartupBarrier(store, 0, 2, stale_after=0.5).start()
    stuck = StartupBarrier(client(store), 1, 2, stale_after=0.5).start()  # beats, never arrives
    with pytest.raises(CollectiveTimeoutError, match="rank 1 was still starting"):
        early.arrive(limit=1.0)
    stuck._stop_beating()


@pytest.mark.slow
def test_a_rank_tokenizing_past_the_startup_timeout_does_not_fail_the_start(
    tmp_path: Path, procs: list[Proc]
) -> None:
    """Real torchrun, gloo: rank 1's data phase takes 12 s, longer than the job's 10 s
    startup collective timeout; rank 0 waits at the barrier (before, it timed out in DDP's
    first broadcast) and the job trains."""
    job = make_job(training={"maxSteps": 2, "warmupSteps": 0})
    job.spec.fault_tolerance.startup_collective_timeout_seconds = 10
    job.spec.fault_tolerance.collective_timeout_seconds = 10
    config = write_job(tmp_path / "job.json", job)
    p = launch_standalone(config, cwd=tmp_path, log=tmp_path / "run.log", procs=procs,
                          FT_DATA_DELAY_SECONDS="12", FT_DATA_DELAY_RANK="1")  # fmt: skip
    assert p.wait(120) == 0, tail(p.log)
    assert len(step_lines(p.log)) == 2
    text = p.log.read_text()
    assert "waiting for rank(s) 1 to finish starting" in text, tail(p.log)


def test_ranks_of_one_round_that_count_restarts_differently_meet(store: TCPStore) -> None:
    """A replacement pod's agent starts at restart count 0 while the survivors' agents counted
    the failure that lost its predecessor: on a store of its own per round (the worker pod's
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) they are one round and must meet."""
    survivor = round_name(1, agent_store=False)
    replacement = round_name(0, agent_store=False)
    early = StartupBarrier(store, 0, 2, stale_after=5.0, round_id=survivor).start()
    late = StartupBarrier(client(store), 1, 2, stale_after=5.0, round_id=replacement).start()
    done = threading.Thread(target=late.arrive, args=(30.0,))
    done.start()
    early.arrive(limit=10.0)  # a CollectiveTimeoutError here: the ranks never saw each other
    done.join(10)
    assert not done.is_alive()
    # On the agent's store, shared by every round, the count names the round.
    assert round_name(2, agent_store=True) == 2
