"""Where the ranks meet after their own start-up work: through the store, not a collective.

Between creating the process group and loading the model each rank does work of its own
whose length differs from rank to rank and pod to pod: a pod's copy of an `s3://` corpus
(one local rank downloads, data/remote.py), the data cache (one pod builds the blocks while
the others wait for its publication, data/build_claim.py; a replacement pod with no shared
copy tokenizes the whole corpus; an entry over the cache's budget is tokenized by every
rank in memory), and a Hugging Face hub snapshot a replacement pod downloads while its peers
have theirs. The first collective after that work (model loading: DDP's parameter broadcast,
FSDP's sharding, the replica all-gather) was where the early ranks waited for the late ones,
under the startup collective timeout: a tokenization longer than it (minutes per GB) failed
the collective (gloo's recv, NCCL's watchdog), and torchrun restarted the group into the same
work, again and again.

So the ranks meet here first, over the process group's store: under torchrun with
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (the worker pod, the image and the launcher set it) a
TCPStore that worker rank 0 hosts on a new port every rendezvous round, so every start of the
workers finds it empty (a store shared across rounds would hold the previous round's count:
the ranks would go on at once and wait in the collective, as before). A trainer started by a
hand-run torchrun whose rendezvous is static (its default without `--rdzv-backend`) or c10d
with that variable unset gets the agent's store instead (TORCHELASTIC_USE_AGENT_STORE=True),
the same one in every round: there the keys are named by torchelastic's restart count
(`round_name`). Only there: with a store of its own per round, the ranks of one round may
count differently (a replacement pod's agent starts at 0 while the survivors' agents counted
the failure that lost its predecessor), and keys named by the count would keep them from ever
meeting. Each rank publishes a beat from a thread
while it works (a count, and its start-up phase and progress: startup_progress.py), and marks
itself ready when its start-up work is done. A ready rank polls the ready count and reads the
others' beats once per heartbeat, each judged on the reader's own clock (the ranks' clocks are
never compared, only what they published):
- a missing rank whose beat count keeps changing and whose progress keeps moving, however
  slowly, is waited for, up to `wait_limit` in all;
- one whose beat has not changed for the startup collective timeout is lost (power, partition,
  a frozen process): a `CollectiveTimeoutError`, as the crash report and the operator read a
  lost peer; a silent peer loss costs what it cost before;
- one that beats but whose progress has not moved for its phase's stall limit
  (`startup_progress.stall_limit`: the startup timeout, more for a phase whose progress comes
  in large steps) is stuck: a hung download socket, a deadlocked tokenizer worker, an NFS
  mount that blocks. Its own beat thread sees it first (the same count, its own clock) and
  ends its process with a `StartupStalledError` in its error file, naming the phase and where
  its main thread is: the failure is its own (not a lost peer's), and torchrun restarts the
  group in place, on the same nodes, as for any rank's failure (one restart of
  `--max-restarts`; the pod fails only once those are spent). Its
  peers wait two heartbeats longer (its last beat reaches them up to one later) and then fail
  as for a lost peer, naming it, its phase and its last progress. (A hang that holds the GIL
  stops the beat thread too: that rank reads as lost, after the same startup timeout.)
Collectives are never widened for the work: model loading and the first steps keep the plan's startup
timeout (and the steady one afterwards, collective_timeout.py).

Load on the store: each rank sets its beat key every `heartbeat_seconds` (one request, as the
counter's add was); a waiting rank reads one counter per poll (backing off to `POLL_S`) and
every rank's beat (one multi-get) once per heartbeat, plus one request per rank that has not
beaten yet.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Protocol, Self

from finetune_operator.api.elastic_timeouts import NODE_STORAGE_BYTES_PER_S
from finetune_operator.api.jobconfig import JobConfig
from finetune_trainer.crash import record_exception
from finetune_trainer.data.build_claim import SLOW_BUILD_BYTES_PER_S, wait_bound
from finetune_trainer.data.cache_key import corpus_bytes, files_identity
from finetune_trainer.data.remote import StagedDataset
from finetune_trainer.distributed import CollectiveTimeoutError, exit_process
from finetune_trainer.startup_beats import (
    Beat,
    PeerView,
    StartupStalledError,
    Verdict,
    decode_beat,
    encode_beat,
    is_stuck,
    missing_ranks,
    observe,
    verdict,
)
from finetune_trainer.startup_progress import PROGRESS, Sample, StartupProgress, stall_limit

log = logging.getLogger(__name__)

PREFIX = "ft-startup"
# Peers judge a stuck rank this many of its heartbeats after it judges itself: its last beat
# reaches them up to one heartbeat late, and its own failure (the cause) should come first.
STUCK_GRACE_BEATS = 2
HEARTBEAT_CEILING_S = 5.0
FIRST_POLL_S = 0.05
POLL_S = 1.0
# A hub snapshot's (or dataset's) size is not known before it is downloaded: an hour covers
# tens of GB at the tens of MB/s the hub serves a node.
HUB_SNAPSHOT_ALLOWANCE_S = 3600.0


class BarrierStore(Protocol):
    """What the barrier uses of a `torch.distributed.Store`."""

    def add(self, key: str, value: int) -> int: ...
    def set(self, key: str, value: str) -> None: ...
    def check(self, keys: list[str]) -> bool: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def get(self, key: str) -> bytes: ...


def heartbeat_seconds(stale_after: float) -> float:
    """Pure: how often a rank beats: several beats within `stale_after`, at most every 5 s."""
    return min(HEARTBEAT_CEILING_S, stale_after / 5)


def wait_limit(
    startup_s: float,
    corpus_bytes: int,
    *,
    downloaded: bool,
    hub_snapshot: bool,
    hub_dataset: bool = False,
) -> float:
    """Pure: the longest a ready rank waits for the others at the barrier, however alive
    they are: the startup collective timeout (what it waited before) plus the start-up work
    a rank may legitimately do while its peers wait: a corpus of `corpus_bytes` downloaded at
    a node's storage rate (`downloaded`: it is on object storage), a waiter that gives up on
    another pod's build (`build_claim.wait_bound`) and then tokenizes the corpus itself at a
    slow node's rate, and a hub snapshot (`hub_snapshot`). A hub dataset (`hub_dataset`)
    has no size before it is downloaded (`corpus_bytes` 0), and the data cache does not keep
    it: a replacement pod downloads it while its peers have theirs, then every rank tokenizes
    it; it gets the hub's allowance too."""
    limit = startup_s + wait_bound(corpus_bytes, None) + corpus_bytes / SLOW_BUILD_BYTES_PER_S
    if downloaded:
        limit += corpus_bytes / NODE_STORAGE_BYTES_PER_S
    if hub_snapshot:
        limit += HUB_SNAPSHOT_ALLOWANCE_S
    if hub_dataset:
        limit += HUB_SNAPSHOT_ALLOWANCE_S
    return limit


def job_wait_limit(job: JobConfig, startup_s: float, staged: StagedDataset | None) -> float:
    """`wait_limit` for this job's corpus (`staged`: its pod's copy of an `s3://` corpus)
    and model."""
    files = staged.files if staged is not None else files_identity(job.spec.dataset)
    return wait_limit(startup_s, corpus_bytes(files), downloaded=staged is not None,
                      hub_snapshot=job.spec.model.source == "hub",
                      hub_dataset=files is None)  # fmt: skip


def round_name(restart_count: int, *, agent_store: bool) -> int:
    """Pure: what names this round's keys (module docstring): torchelastic's restart count
    where the store is the agent's, shared by every round; nothing where it is new per round."""
    return restart_count if agent_store else 0


class StartupBarrier:
    """This rank's beats while it starts (`start`), and the meeting (`arrive`).
    `stale_after`: the startup collective timeout; `round_id`: what names this round's keys
    (`round_name`; module docstring); `progress`: what this rank's work reports into;
    `on_stuck`: what ends this rank when its progress stood still past its phase's limit
    (tests record it instead)."""

    def __init__(
        self,
        store: BarrierStore,
        rank: int,
        world_size: int,
        stale_after: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        *,
        round_id: int = 0,
        progress: StartupProgress = PROGRESS,
        on_stuck: Callable[[StartupStalledError], None] | None = None,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._prefix = f"{PREFIX}/{round_id}"
        self._ready_key = f"{self._prefix}/ready"
        self.stale_after = stale_after
        self.heartbeat_s = heartbeat_seconds(stale_after)
        self.clock, self.sleep = clock, sleep
        self.progress, self.on_stuck = progress, on_stuck or end_stuck_rank
        self._seen: set[int] = set()  # ranks whose beat key exists
        self._count = 0
        self._last: Sample | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="startup-beat", daemon=True)
        self.started = self._progressed = clock()

    def start(self) -> Self:
        self._publish()  # the key exists before anyone reads it
        self._thread.start()
        return self

    def _publish(self) -> tuple[Sample, float]:
        """Set this rank's beat; its progress sample and stall limit."""
        sample = self.progress.sample()
        if self._last is None or (sample.phase, sample.progress) != (
            self._last.phase,
            self._last.progress,
        ):
            self._last, self._progressed = sample, self.clock()
        limit = stall_limit(self.stale_after, sample.extra_s)
        self._count += 1
        beat = Beat(self._count, sample.phase, sample.progress, limit)
        self.store.set(self._beat_key(self.rank), encode_beat(beat))
        return sample, limit

    def agree_round_id(self) -> str:
        """This worker group's id, the same on every rank of the round and new each round:
        rank 0 makes a random one, the others read it (a blocking get: rank 0 sets it as soon
        as the group is formed). The launcher counts a failure of the pod's own by the round
        it happened in (launch.attempt_round), so a failure every pod hits at once is one
        restart of the job (reconcile/budget.py). Not torch's rendezvous round number: torch
        keeps it in private attributes of its rendezvous handler."""
        key = f"{self._prefix}/round_id"
        if self.rank == 0:
            self.store.set(key, uuid.uuid4().hex[:16])
        return self.store.get(key).decode()

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                sample, limit = self._publish()
            except (RuntimeError, OSError) as e:  # a missed beat; the store may be going
                log.warning("start-up heartbeat missed (%r)", e)
                continue
            if is_stuck(self._progressed, self.clock(), limit):
                self.on_stuck(StartupStalledError(
                    f"rank {self.rank} made no start-up progress for {limit:.0f}s in phase "
                    f"{sample.phase!r} (progress count {sample.progress}; main thread "
                    f"{_main_thread_at()}): stuck (a download, a read or a worker that never "
                    "returns); this rank ends so that torchrun restarts the group"
                ))  # fmt: skip
                return

    def _beat_key(self, rank: int) -> str:
        return f"{self._prefix}/beat/{rank}"

    def _stop_beating(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _beats(self) -> list[Beat | None]:
        # Only the keys of ranks not seen beating yet are looked for (a beat key, once
        # created, stays), one at a time when some are missing: a multi-get waits for every
        # key it names, and `add` of 0 would create them. Asking each of the world's keys
        # instead, every waiter would send 2N requests per heartbeat to rank 0's store
        # while one rank never beat (lost before its first): 100k a second at 512 ranks.
        unseen = [r for r in range(self.world_size) if r not in self._seen]
        if unseen and self.store.check([self._beat_key(r) for r in unseen]):
            self._seen.update(unseen)
        else:
            self._seen.update(r for r in unseen if self.store.check([self._beat_key(r)]))
        seen = sorted(self._seen)
        values = self.store.multi_get([self._beat_key(r) for r in seen]) if seen else []
        beats: list[Beat | None] = [None] * self.world_size
        for r, v in zip(seen, values, strict=True):
            beats[r] = decode_beat(v)
        return beats

    def arrive(self, limit: float) -> float:
        """Mark this rank ready and wait until every rank is; the seconds waited. Raises a
        `CollectiveTimeoutError` naming the rank for a lost or stuck peer or past `limit`."""
        self._stop_beating()
        self.store.set(self._beat_key(self.rank), encode_beat(Beat(0, ready=True)))
        self.store.add(self._ready_key, 1)
        t0 = now = self.clock()
        views = [PeerView(None, now, now) for _ in range(self.world_size)]
        next_read, delay, told = now, FIRST_POLL_S, False
        grace = STUCK_GRACE_BEATS * self.heartbeat_s
        while self.store.add(self._ready_key, 0) < self.world_size:
            now = self.clock()
            if now >= next_read:
                views = observe(views, self._beats(), now)
                next_read = now + self.heartbeat_s
                step, rank = verdict(views, now, started=self.started, grace=grace,
                                     stale_after=self.stale_after, limit=limit)  # fmt: skip
                if step in ("lost", "stuck", "too long") and rank is not None:
                    raise CollectiveTimeoutError(
                        self._failure(step, views[rank], rank, now - t0, limit)
                    )
                if not told and step == "wait":
                    log.info("start-up: waiting for rank(s) %s to finish starting (alive, "
                             "beating)", _short(missing_ranks(views)))  # fmt: skip
                    told = True
            self.sleep(min(delay, POLL_S))
            delay *= 2
        return self.clock() - t0

    def _failure(
        self, step: Verdict, view: PeerView, rank: int, waited: float, limit: float
    ) -> str:
        beat = view.beat
        if step == "lost":
            return (
                f"rank {rank} stopped beating for {self.stale_after:.0f}s while starting "
                f"(waited {waited:.0f}s at the start-up barrier): a peer was lost (node lost, "
                "network partition, or a killed rank); torchrun re-forms the group"
            )
        if step == "stuck" and beat is not None:
            return (
                f"rank {rank} made no start-up progress for {beat.stall_s:.0f}s in phase "
                f"{beat.phase!r} (last progress count {beat.progress}; it beats, so it is "
                f"alive but stuck; waited {waited:.0f}s at the start-up barrier): its own pod "
                "ends it; torchrun re-forms the group"
            )
        return (
            f"rank {rank} was still starting {limit:.0f}s after the group formed (alive and "
            "progressing, but past what downloading and tokenizing the corpus may take): "
            "treated as a hung peer; torchrun re-forms the group"
        )


def _main_thread_at() -> str:
    """Where the main thread is now (file:line in function): where a stuck rank is stuck."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "not found"
    return f"at {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


# How long a stuck rank's exit may take its logging and flushing before it is forced.
STUCK_EXIT_GRACE_S = 10.0


def end_stuck_rank(error: StartupStalledError) -> None:
    """End this process with `error` in its error file (torchrun reports it as this rank's
    failure). From the beat thread: the main thread is the one that is stuck, so raising
    there is impossible; `exit_process` does not wait for it.

    The stuck main thread may hold a lock this path needs: a logging handler's, blocked
    writing to a full stderr pipe or a hung log volume (logging and `exit_process`'s flush
    would wait on it forever, and the peers would call this rank lost, not stuck). So the
    error file is written first, and a timer ends the process `STUCK_EXIT_GRACE_S` later
    whatever the rest does."""
    watchdog = threading.Timer(STUCK_EXIT_GRACE_S, os._exit, args=(1,))
    watchdog.daemon = True
    watchdog.start()
    try:
        raise error
    except StartupStalledError as e:  # recorded with a traceback, as `record` would
        record_exception(e)
    log.error("start-up: %s", error)
    exit_process(1)


def _short(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
