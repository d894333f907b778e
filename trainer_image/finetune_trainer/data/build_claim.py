"""One pod of a fresh job builds the data cache's entry; the others wait for its publication.

The pods of a fresh job start together with empty caches and an empty shared copy
(`shared.py`): without an election each of N nodes tokenizes the whole corpus at once (minutes
of CPU per GB on every node) and all but one throw the result away. With it, the first pod to
claim the key builds and publishes while the others poll the shared copy and copy the entry
(verified against its checksum, as a replacement pod does) once it is there:

    <checkpoint.uri>/.data-cache/.<key>.building    the builder's claim: holder and heartbeat
    <checkpoint.uri>/.data-cache/.<key>.skip        the blocks do not fit the builder's budget

**Elected through the shared storage, not over the process group.** The cache is consulted
after the process group exists, but a group election ("rank 0's pod builds") would have to
know, before anyone looked, which pods find the entry locally, in the shared copy, or not at
all (a replacement pod beside running ones, a rank 0 whose emptyDir survived a restart), and
every pod would have to agree on it through a collective whose startup timeout does not cover
a tokenization. The claim is self-describing instead: a pod waits only while a live claim
exists, and only the storage every pod already shares can hold it. (Within a pod the local
ranks already serialise on the entry's flock: one of them takes part in the election.) No collective is issued
while waiting or building: the ranks meet after the data phase at the start-up barrier
(finetune_trainer/startup_barrier.py, through the group's store, waiting for peers that are
alive), and the waiters arrive there one copy of the entry after the builder (seconds), not a
build later; a waiter that gives up (below: the build stopped advancing) arrives at most
`wait_bound` plus a build after the builder's last progress. The trainer caps the bound at a
fraction of the startup collective timeout (`CacheSettings.wait_limit_s`): a builder that
has not advanced for that long is stuck rather than slow.

**Atomic claim.** On a filesystem the claim is created with O_EXCL (atomic locally and on
NFSv3+). On `s3://` it is a conditional PUT (`If-None-Match: *`, s3fs's `mode="create"`): AWS
S3 and moto refuse the second with 412. A store that ignores the header (older S3-compatible
servers) lets two pods claim: both build and publish, as every pod did before, which is safe
(publications of one key carry the same bytes, and nothing unverified is ever loaded).

**Liveness by observed change.** The builder rewrites its claim every `HEARTBEAT_S` with a beat
counter. A waiter judges the claim by whether its content changed within `STALE_AFTER_S` of
the waiter's own monotonic clock, never by comparing timestamps: pods' clocks, the NFS server's
mtimes (attribute caching up to a minute) and S3's LastModified need not agree. A stale claim
(the builder's pod died) is removed and claimed by a waiter, which builds; a claim of this
pod's own whose process is gone (a worker torchelastic restarted mid-build, or the pod
replaced under its name: the claim names the holder's boot and start, as its pid may be reused)
is taken over at once. A waiter also gives up and builds itself once the build has not
advanced for `wait_bound` (from the corpus's size: a builder alive but stuck; the heartbeat
carries the bytes built so far, so a slow build that advances is waited for), or when the
claim goes away without an entry (the builder failed or could not publish): then each
remaining pod builds for itself, as before, rather than in turn.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Literal, TypeVar

from finetune_trainer.location import Location
from finetune_trainer.startup_progress import advance

log = logging.getLogger(__name__)

HEARTBEAT_S = 15.0
# Several heartbeats: a builder's pod under CPU pressure (it is tokenizing on every core) or a
# slow NFS server may miss one or two.
STALE_AFTER_S = 120.0
# Polls start fast and back off to POLL_S: a small corpus's build is over in well under a
# second, a large one's in minutes, where a poll every 2 s costs nothing.
FIRST_POLL_S = 0.05
POLL_S = 2.0
# A builder is given what tokenizing the corpus takes at a slow node's rate (a byte-level BPE
# on one core: ~1 MB/s), plus start-up; a build slower than that is a stuck builder.
WAIT_FLOOR_S = 60.0
SLOW_BUILD_BYTES_PER_S = 1e6

Step = Literal["fetch", "skip", "claim", "take over", "give up", "wait"]
T = TypeVar("T")


def wait_bound(source_bytes: int | None, limit_s: float | None) -> float:
    """Pure: how long a pod waits for another's build of a corpus of `source_bytes` before
    building itself; never over `limit_s` (a share of the startup collective timeout)."""
    bound = WAIT_FLOOR_S + (source_bytes or 0) / SLOW_BUILD_BYTES_PER_S
    return bound if limit_s is None else max(0.0, min(bound, limit_s))


def is_stale(last_change: float, now: float, stale_after: float = STALE_AFTER_S) -> bool:
    """Pure: a claim whose content was last seen changing at `last_change` (the waiter's own
    clock) belongs to a builder that died."""
    return now - last_change > stale_after


def next_step(
    *,
    entry_whole: bool,
    skipped: bool,
    claimed: bool,
    saw_claim: bool,
    holder_gone: bool = False,
    last_change: float,
    started: float,
    now: float,
    bound: float,
    stale_after: float = STALE_AFTER_S,
) -> Step:
    """Pure: what a pod without the entry does next. `claimed`: a claim is there now (read
    before the entry, so a claim gone with no entry means the builder quit without
    publishing: it publishes before releasing); `saw_claim`: one was there earlier;
    `holder_gone`: the claim names a process of this pod that no longer runs; `started`:
    when the wait began, or the build last advanced."""
    if entry_whole:
        return "fetch"
    if skipped:
        return "skip"
    if not claimed:
        return "give up" if saw_claim else "claim"
    if holder_gone or is_stale(last_change, now, stale_after):
        return "take over"
    if now - started > bound:
        return "give up"
    return "wait"


@dataclass
class Turn(Generic[T]):
    """The election's outcome for this pod: `found` (a verified entry the builder published),
    `skip` (too big to cache: tokenize in memory), or build, holding `claim` when elected
    (None: building without it, after giving up)."""

    found: T | None = None
    skip: bool = False
    claim: BuildClaim | None = None


def _holder() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def incarnation(pid: int) -> str | None:
    """Which process `pid` is, beyond its number: the node's boot and the process's start
    (in ticks since boot); None where /proc does not say (not running, not Linux). A worker
    pod replaced under the same name (the operator's pods keep theirs) has the same host
    name, and its workers, in a fresh PID namespace, often the same pids as the dead ones."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return f"{boot}:{fields[19]}" if len(fields) > 19 else None


def create_exclusive(target: Location, data: bytes) -> bool:
    """Create `target` holding `data` unless it exists: True if this call created it."""
    if target.is_local:
        try:
            fd = os.open(target.local_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    try:
        target.fs.pipe_file(target.path, data, mode="create")  # If-None-Match: *
    except FileExistsError:  # s3fs's reading of 412 PreconditionFailed on a create
        return False
    return True


def holder_gone(claim: bytes | None) -> bool:
    """The claim was taken by a process of this pod (its host name) that has died: a worker
    restarted by torchelastic mid-build, or the pod itself replaced under the same name (its
    pid now another process's, or this one's: a process electing holds no claim). No need to
    wait for its heartbeat to go stale."""
    try:
        found = json.loads(claim or b"{}")
        host, _, pid_text = str(found.get("holder", "")).rpartition("-")
        if host != socket.gethostname():
            return False
        pid = int(pid_text)
        if pid == os.getpid():
            return True
        theirs = found.get("incarnation")
        if theirs is not None and incarnation(os.getpid()) is not None:
            return bool(theirs != incarnation(pid))  # None: no process has that pid now
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (ValueError, OSError, AttributeError):
        pass  # unreadable, not ours, or alive but not signallable: judged by its heartbeat
    return False


def skips(marker: bytes | None, budget: int | None) -> bool:
    """Pure: whether a pod with `budget` bytes for the entry goes without it, given the skip
    `marker` a builder left (None: none). The builder's budget was its own (its cache limit
    less its other entries, its node's free space): a pod with more room builds instead of
    giving up caching for the job's whole life."""
    if marker is None:
        return False
    try:
        over = json.loads(marker).get("over_bytes")
    except (ValueError, AttributeError):
        return True  # a marker without the builder's budget
    return budget is None or not isinstance(over, int) or budget <= over


def built_bytes(claim: bytes | None) -> int | None:
    """Pure: the build's progress a claim reports (None: not reported, or no claim)."""
    try:
        value = json.loads(claim or b"{}").get("built_bytes")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def read_or_none(target: Location, attempts: int = 3) -> bytes | None:
    """The file's bytes, None if absent. Each call opens it anew (NFS revalidates on open:
    close-to-open). ESTALE is retried: on NFS a heartbeat renamed over the file between this
    pod's open and read, and the error would otherwise end the election (this pod building)."""
    for attempt in range(attempts):
        try:
            return target.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno != errno.ESTALE or attempt == attempts - 1:
                raise
    return None


class BuildClaim:
    """This pod's claim on building `key`, heartbeaten from a thread until released."""

    def __init__(self, path: Location, skip_path: Location, heartbeat_s: float) -> None:
        self.path, self.skip_path, self.heartbeat_s = path, skip_path, heartbeat_s
        self.holder = _holder()
        self.incarnation = incarnation(os.getpid())
        # The bytes built so far (set once the build writes): a waiter waits for a builder
        # that advances, however long it takes, and gives up only on one that does not.
        self.progress: Callable[[], int] | None = None
        self._beat = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="data-cache-claim", daemon=True)

    def content(self) -> bytes:
        mine = {"holder": self.holder, "incarnation": self.incarnation, "beat": self._beat}
        if self.progress is not None:
            mine["built_bytes"] = self.progress()
        return json.dumps(mine).encode()

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._beat += 1
            try:
                if not self._still_mine():  # taken over while this pod stalled: let it be
                    log.warning("data cache: the build claim %s was taken over", self.path)
                    return
                self.path.write_atomic(self.content(), tmp_tag=f"-{self.holder}")
            except OSError as e:  # a missed beat; too many and a waiter takes over (harmless)
                log.warning("data cache: could not renew the build claim %s (%r)", self.path, e)

    def _still_mine(self) -> bool:
        try:
            current = read_or_none(self.path)
            return current is not None and json.loads(current).get("holder") == self.holder
        except (ValueError, AttributeError):
            return False

    def release(self) -> None:
        """Stop the heartbeat and remove the claim if it is still this pod's."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with contextlib.suppress(OSError):
            if self._still_mine():
                self.path.remove()

    def mark_skipped(self, reason: str, budget: int | None = None) -> None:
        """The blocks do not fit this pod's `budget`: no pod with no more room waits for them
        again (logged if the marker cannot be written: the waiters then each build, as
        without the election)."""
        marker = json.dumps({"reason": reason, "over_bytes": budget}).encode()
        try:
            self.skip_path.write_atomic(marker, tmp_tag=f"-{self.holder}")
        except OSError as e:
            log.warning("data cache: could not mark %s too big (%r)", self.skip_path, e)

    @contextlib.contextmanager
    def held(self) -> Iterator[BuildClaim]:
        try:
            yield self
        finally:
            self.release()


@dataclass
class Election:
    """Waits for, or takes, the building of one key under `root` (the shared copy)."""

    root: Location
    key: str
    heartbeat_s: float = HEARTBEAT_S
    stale_after_s: float = STALE_AFTER_S
    poll_s: float = POLL_S
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    @property
    def claim_path(self) -> Location:
        return self.root / f".{self.key}.building"

    @property
    def skip_path(self) -> Location:
        return self.root / f".{self.key}.skip"

    def try_claim(self) -> BuildClaim | None:
        claim = BuildClaim(self.claim_path, self.skip_path, self.heartbeat_s)
        self.root.makedirs()
        if not create_exclusive(self.claim_path, claim.content()):
            return None
        claim.start()
        return claim

    def run(
        self,
        entry_whole: Callable[[], bool],
        fetch: Callable[[], T | None],
        bound: float,
        budget: int | None = None,
    ) -> Turn[T]:
        """Fetch the entry once whole, or build (elected or not), or skip (a builder with no
        more than `budget` bytes found the blocks too big)."""
        started = self.clock()
        seen: bytes | None = None
        last_change, saw_claim, told, delay = started, False, False, FIRST_POLL_S
        # The wait is bounded from the builder's last progress, not from the start: waiting
        # for a builder that advances costs the collective nothing (this pod arrives one copy
        # after it), giving up on it costs a build (and the CPU the election saves).
        progress, progressed = None, started
        while True:
            now = self.clock()
            current = read_or_none(self.claim_path)  # before the entry: see next_step
            if current != seen:
                seen, last_change = current, now
                reported = built_bytes(current)
                if reported is not None and reported != progress:
                    progress, progressed = reported, now
                    advance()  # the builder's progress is this waiting rank's (startup_progress)
            step = next_step(
                entry_whole=entry_whole(),
                skipped=skips(read_or_none(self.skip_path), budget),
                claimed=current is not None,
                saw_claim=saw_claim,
                holder_gone=holder_gone(current),
                last_change=last_change,
                started=progressed,
                now=now,
                bound=bound,
                stale_after=self.stale_after_s,
            )
            saw_claim = saw_claim or current is not None
            if step == "fetch":
                found = fetch()
                if found is None:
                    log.warning("data cache: the published entry %s is unusable here", self.key)
                return Turn(found=found)  # None: build without the claim
            if step == "skip":
                return Turn(skip=True)
            if step == "give up":
                log.warning("data cache: gave up waiting for another pod's build of %s after "
                            "%.0f s: tokenizing here", self.key, now - started)  # fmt: skip
                return Turn()
            if step == "take over":
                log.warning("data cache: the build claim %s has not changed for %.0f s (its pod "
                            "died): taking it over", self.claim_path, now - last_change)  # fmt: skip
                if read_or_none(self.claim_path) == current:  # not someone's new claim
                    self.claim_path.remove()
                step = "claim"
            if step == "claim":
                claim = self.try_claim()
                if claim is not None:
                    return Turn(claim=claim)
                continue  # another pod's claim came first: look at it
            if not told:
                log.info("data cache: another pod is building %s: waiting for it", self.key)
                told = True
            self.sleep(min(delay, self.poll_s))
            delay *= 2
