"""The job's shared copy of the data cache, so that a replacement pod never tokenizes again.

The per-pod cache (`cache.py`) lives in an emptyDir: a pod that replaces another (a straggler
evicted, a node lost, a spot reclaim: on another node) starts with it empty. Every pod of the
job already mounts the job's checkpoint storage, so the first pod to build an entry publishes
it there, and a new pod looks in its own cache, then there, and tokenizes only if neither has
the entry:

    <checkpoint.uri>/.data-cache/<key>/blocks.bin, meta.json     (the entry, as in cache_entry.py)
    <checkpoint.uri>/.data-cache/.<key>.publishing                 who is publishing it now
    <checkpoint.uri>/.data-cache/.<key>.building, .<key>.skip      a fresh job's election
    <checkpoint.uri>/.data-cache/.<key>.tmp-<host>-<pid>/          a publication in progress

The checkpoint code never sees it (it lists only `step-*` directories) and this module never
touches anything outside it.

**Copied, not mapped from there.** A new pod copies the entry into its local cache (one
sequential read, verified against the checksum the entry carries) and maps the local copy.
Mapping the shared file instead would turn every rank's batch reads into random reads over
the network for the whole run (NFS, CephFS, EFS: a round trip per page fault, on every node),
a server hiccup into ranks stuck in page faults mid-step (uninterruptible, not a clean error),
and a republication or clean-up of the shared entry into ESTALE or SIGBUS under a running
trainer; an object store cannot be mapped at all. The checksum has to read every byte once
anyway: copying while at it costs only the local write, and the run is then independent of
the shared volume. The price is local disk the size of the entry: the same as building it.

**Atomic publication.** On a filesystem an entry is written under a name of its own
(`.<key>.tmp-<host>-<pid>`), its bytes hashed while copied and checked against the entry's
checksum, fsynced, and renamed to `<key>` (atomic on POSIX and NFS): a reader sees a whole entry
or none. The pods of a fresh job elect one builder (`build_claim.py`: a `.<key>.building`
claim, heartbeaten; the others wait for the entry and copy it); where more than one builds
anyway (a dead builder's claim taken over, a waiter that gave up) the first to create
`.<key>.publishing` (exclusively) publishes and the others skip, so the volume gets one copy. If
two publish anyway (a stale claim taken over), each writes its own temporary directory; the
rename of the second fails (the target exists and is not empty) and it removes its copy. On an object
store (`s3://`, through the same `Location` as checkpoints) there is no rename: the blocks are
put first and `meta.json` last, each PUT atomic, and publishers of the same key put the same
bytes. Either way a reader trusts nothing it has not verified: a partial or damaged shared
entry is never installed; the pod tokenizes and publishes over it.

**Bounded.** After a pod fetches or publishes key K, entries of other keys (the job's data,
tokenizer or sequence length changed since) are removed, and so are temporary directories
and claims of publishers gone for `ABANDONED_SECONDS` (on an object store: other keys' build
claims and skip markers unchanged that long): the shared copy holds one entry per job.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import xxhash

from finetune_operator.api.spec import CheckpointSpec
from finetune_operator.api.storage import ObjectStoreSpec
from finetune_trainer.checkpoint_store import resolve_root
from finetune_trainer.data import build_claim
from finetune_trainer.data.cache_entry import BLOCKS_FILE, META_FILE  # an entry is copied as is
from finetune_trainer.files import fsync_dir, remove, write_synced
from finetune_trainer.location import Location
from finetune_trainer.ownership import claim_checkpoint_root
from finetune_trainer.startup_progress import advance

log = logging.getLogger(__name__)
T = TypeVar("T")

SHARED_DIR = ".data-cache"
# A publication in progress writes continuously; one not written to for this long is a pod
# that died mid-copy, and its temporary directory is removed by the next pod.
ABANDONED_SECONDS = 600.0
_COPY_CHUNK = 16 << 20


def is_abandoned(last_write: float, now: float, grace: float = ABANDONED_SECONDS) -> bool:
    """Pure: a temporary directory last written at `last_write` belongs to a dead publisher."""
    return now - last_write > grace


def entry_bytes(meta: dict[str, Any]) -> int:
    """Pure: the size of the blocks file a meta describes."""
    return int(meta["rows"]) * int(meta["seq_len"]) * int(np.dtype(meta["dtype"]).itemsize)


@dataclass
class SharedCache:
    """Entries under `root` (`<checkpoint root>/.data-cache`). `claim` is called before the
    first access: it makes sure the checkpoint root is this job's (another job's storage is
    never read or written) and raises if it is not."""

    root: Location
    claim: Callable[[], None] = lambda: None
    # The fresh-job election's timing (build_claim.py); tests shorten them.
    heartbeat_s: float = build_claim.HEARTBEAT_S
    stale_after_s: float = build_claim.STALE_AFTER_S
    poll_s: float = build_claim.POLL_S
    _claimed: bool = field(default=False, init=False)

    def _ensure_claimed(self) -> None:
        if not self._claimed:
            self.claim()
            self._claimed = True

    def _state(self, key: str) -> tuple[str, dict[str, Any] | None]:
        """`absent`, `damaged` (a meta that does not parse or names another key, blocks
        missing or of the wrong size) or `whole` (checked cheaply: its checksum is verified
        by whoever copies it), with the meta when whole."""
        entry = self.root / key
        # On a volume an entry appears whole (a rename): a directory without its meta is
        # damage. On an object store it is a publication under way (blocks go first). The
        # directory is looked for before the meta is read: looked for after, another pod's
        # rename between the two would make a whole entry look damaged (and be replaced).
        existed = self.root.is_local and entry.exists()
        try:
            meta = json.loads((entry / META_FILE).read_text())
        except FileNotFoundError:
            return ("damaged" if existed else "absent"), None
        except (ValueError, UnicodeDecodeError):
            return "damaged", None
        try:
            if not isinstance(meta, dict) or meta.get("key") != key:
                return "damaged", None
            size = (self.root / key).sizes().get(BLOCKS_FILE)
            return ("whole", meta) if size == entry_bytes(meta) else ("damaged", None)
        except (KeyError, TypeError, ValueError):
            return "damaged", None

    def election(self, key: str) -> build_claim.Election:
        """Who builds `key` when no pod has it yet (build_claim.py)."""
        self._ensure_claimed()
        return build_claim.Election(
            self.root, key, self.heartbeat_s, self.stale_after_s, self.poll_s
        )

    def await_build(
        self, key: str, fetch: Callable[[], T | None], bound: float, budget: int | None = None
    ) -> build_claim.Turn[T] | None:
        """No pod has published `key`: wait for the pod building it and `fetch` its entry
        (verified by the caller), or get the claim to build it; None (logged) when the
        shared copy cannot be used for it (the pod builds, as without one). `budget`: the
        bytes this pod has for the entry (a skip marker of a pod with less is not its own)."""
        try:
            return self.election(key).run(lambda: self.is_whole(key), fetch, bound, budget)
        except (OSError, ValueError, KeyError, TypeError) as e:  # as cache._SHARED_ERRORS
            log.warning("data cache: cannot elect a builder in %s (%r): tokenizing", self.root, e)
            return None

    def is_whole(self, key: str) -> bool:
        return self._state(key)[0] == "whole"

    # ---- reading ---------------------------------------------------------------------------

    def fetch(self, key: str, into: Path, budget: int) -> str:
        """Copy the published entry `key` into the empty directory `into` (blocks first, meta
        last, as a build writes them): `copied`, `absent`, `damaged`, or `too big` for
        `budget`. The caller verifies a copy before using it: nothing here is trusted."""
        self._ensure_claimed()
        state, meta = self._state(key)
        if meta is None:
            return state
        size = entry_bytes(meta)
        if size > budget:
            log.info("data cache: the shared entry (%d bytes) does not fit here (%d)", size, budget)
            return "too big"
        source = self.root / key / BLOCKS_FILE
        try:
            if self.root.is_local:
                _copy_synced(source.local_path, into / BLOCKS_FILE)
            else:
                self.root.fs.get_file(source.path, str(into / BLOCKS_FILE))
        except FileNotFoundError:
            return "damaged"  # gone since the meta was read: replaced or removed meanwhile
        # The meta read before the blocks, not after: if the entry was replaced in between,
        # the checksum says so and the copy is refused.
        write_synced(into / META_FILE, json.dumps(meta).encode())
        return "copied"

    # ---- writing ---------------------------------------------------------------------------

    def publish(self, key: str, entry: Path, *, replace: bool = False) -> str:
        """Publish the local, verified entry directory `entry`: `published`; `present` when
        another pod's whole copy is already there; `in progress` when another pod is
        publishing it now. A damaged one is replaced, and so is one that looks whole if
        `replace` (its checksum was found wrong by the caller)."""
        self._ensure_claimed()
        state, _ = self._state(key)
        if state == "whole" and not replace:
            return "present"
        replace = state != "absent"
        meta = json.loads((entry / META_FILE).read_text())
        if not self.root.is_local:
            target = self.root / key
            target.makedirs()
            (target / BLOCKS_FILE).upload(entry / BLOCKS_FILE)
            (target / META_FILE).write_atomic(json.dumps(meta).encode())  # last: one PUT
            return "published"
        root = self.root.local_path
        root.mkdir(parents=True, exist_ok=True)
        with _publishing(root / f".{key}.publishing", time.time()) as mine:
            if not mine:
                return "in progress"
            return _publish_local(root, key, entry, meta, replace=replace)

    def prune(self, keep: str, now: float | None = None) -> list[str]:
        """Remove entries of other keys and abandoned publications; returns their names."""
        self._ensure_claimed()
        now = time.time() if now is None else now
        removed = []
        for child in self.root.children():
            name = child.name
            if name in (keep, f".{keep}.building", f".{keep}.skip"):
                continue
            # A publication in progress (or a damaged entry moved aside): only if abandoned.
            if name.startswith(".") and not self._abandoned(name, now):
                continue
            (self.root / name).remove()
            removed.append(name)
        return removed

    def _abandoned(self, name: str, now: float) -> bool:
        if self.root.is_local:
            return is_abandoned(_last_write(self.root.local_path / name, now), now)
        # An object store has no temporary directories (entries are put in place): its dot
        # names are other keys' build claims and skip markers, left for good otherwise (a
        # builder that died, data changed since). A live claim is rewritten every heartbeat.
        try:
            modified = self.root.fs.info((self.root / name).path).get("LastModified")
        except FileNotFoundError:
            return False
        return isinstance(modified, datetime) and is_abandoned(modified.timestamp(), now)


def _publish_local(
    root: Path, key: str, entry: Path, meta: dict[str, Any], *, replace: bool
) -> str:
    """Copy `entry` under a temporary name of this pod's, verify and fsync it, and rename it
    to `<root>/<key>`; `present` if another pod's rename came first."""
    tmp = root / f".{key}.tmp-{socket.gethostname()}-{os.getpid()}"
    remove(tmp)
    tmp.mkdir()
    try:
        digest = _copy_synced(entry / BLOCKS_FILE, tmp / BLOCKS_FILE)
        if digest != meta["xxh3_128"]:
            raise OSError(errno.EIO, f"copy of {entry / BLOCKS_FILE} does not match its checksum")
        write_synced(tmp / META_FILE, json.dumps(meta).encode())
        fsync_dir(tmp)
        if replace:
            _move_aside(root / key)
        try:
            os.rename(tmp, root / key)  # atomic: readers see a whole entry or none
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            return "present"  # another pod published it first: theirs is the same
        fsync_dir(root)
        return "published"
    finally:
        remove(tmp)


@contextlib.contextmanager
def _publishing(claim: Path, now: float) -> Iterator[bool]:
    """One publisher per key at a time (the pods of a fresh job all build at once: without it
    each would write a copy of the entry to the shared volume). The claim is a file created
    exclusively (O_EXCL: atomic locally and on NFSv3+); one older than ABANDONED_SECONDS is a
    dead publisher's and is taken over. Not a correctness guarantee (a taken-over publisher may
    still be alive): the rename in `_publish_local` is."""
    for _ in range(2):
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            if not is_abandoned(_last_write(claim, now), now):
                break
            remove(claim)
            continue
        try:
            yield True
        finally:
            remove(claim)
        return
    yield False


def shared_cache_for(
    checkpoint: CheckpointSpec,
    object_store: ObjectStoreSpec | None,
    owner: dict[str, str],
    cwd: Path | None = None,
) -> SharedCache | None:
    """The shared copy under the job's checkpoint root (a directory on a volume or an s3://
    prefix, resolved as the checkpointer does), claimed for `owner` (job, namespace, uid)
    before use; None for a job that does not checkpoint (it has no storage of its own)."""
    if not checkpoint.enabled:
        return None
    root = resolve_root(checkpoint.uri, cwd, object_store)
    return SharedCache(root / SHARED_DIR, claim=lambda: claim_checkpoint_root(root, owner))


def _copy_synced(source: Path, target: Path) -> str:
    """Copy a file, fsynced, and return the xxh3-128 of the bytes written."""
    h = xxhash.xxh3_128()
    with open(source, "rb") as src, open(target, "wb") as dst:
        while chunk := src.read(_COPY_CHUNK):
            h.update(chunk)
            dst.write(chunk)
            advance(len(chunk))  # a copy to or from a shared volume: start-up progress
        dst.flush()
        os.fsync(dst.fileno())
    return h.hexdigest()


def _move_aside(path: Path) -> None:
    """Make a damaged entry invisible at once (a rename), then delete it."""
    aside = path.with_name(f".{path.name}.damaged-{socket.gethostname()}-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.rename(path, aside)  # another pod may have moved it first
    remove(aside)


def _last_write(path: Path, now: float) -> float:
    try:
        times = [path.stat().st_mtime, *(p.stat().st_mtime for p in path.iterdir())]
    except FileNotFoundError:
        return now  # gone or going: someone else's business
    except NotADirectoryError:
        return path.stat().st_mtime
    return max(times)
