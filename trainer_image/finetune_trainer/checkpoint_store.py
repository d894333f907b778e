"""The checkpoint directory layout, without torch.distributed: discovery, commit markers,
validation, integrity manifests and retention. `<root>/step-00000120/` holds one DCP
checkpoint; a `COMMITTED` file inside it (JSON metadata) says every rank finished writing it
and carries the manifest: size and hash of every file of the checkpoint.

The root is a `Location`: a directory on a volume or an `s3://` prefix, through the same code.
On an object store nothing can be renamed into place, and nothing needs to be: the marker is
written after every shard and the manifest are complete, and a step without it is invisible
(never listed as committed, never loaded, cleaned as partial).

Hash: xxHash3-128 (`xxh3_128`, ~10 GB/s per core here against ~1.4 GB/s for SHA-256). The
manifest guards against damage (bit rot, a torn or overwritten file, a copy gone wrong), not
against an attacker who can write the checkpoint directory (they could rewrite the manifest
too), so a fast non-cryptographic 128-bit hash is the right trade: a multi-GB shard costs well
under a second to hash, in the commit thread, off the training path. `sha256` manifests are
read too (the algorithm is recorded in the marker).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from finetune_operator.api.constants import (
    CHECKPOINT_COMMITTED_MARKER,
    CHECKPOINT_STEP_PREFIX,
    checkpoint_dir_name,
)
from finetune_operator.api.storage import ObjectStoreSpec
from finetune_trainer.location import Location, locate

_STEP_DIR = re.compile(re.escape(CHECKPOINT_STEP_PREFIX) + r"(\d{8,})$")
DCP_METADATA_FILE = ".metadata"
# DCP's FileSystemWriter names each rank's data files `__<rank>_<n>.distcp`.
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")
MANIFEST_KEY = "files"
HASH_KEY = "hash"
HASH_ALGORITHM = "xxh3_128"
_CHUNK = 8 << 20
_HASHERS: dict[str, Callable[[], Any]] = {
    "xxh3_128": xxhash.xxh3_128,
    "sha256": hashlib.sha256,
}
# A checkpoint found damaged at load is renamed with this suffix: kept for inspection, never
# listed again (the step pattern no longer matches), and out of the way of a later save.
CORRUPT_SUFFIX = ".corrupt"


class CorruptCheckpointError(Exception):
    """A committed checkpoint that cannot be read back."""


@dataclass(frozen=True)
class CheckpointDir:
    step: int
    path: Location
    committed: bool


def resolve_root(
    uri: str, cwd: Path | None = None, object_store: ObjectStoreSpec | None = None
) -> Location:
    """A checkpoint URI as a Location (see `location.locate`)."""
    return locate(uri, "checkpoint.uri", cwd=cwd, object_store=object_store)


def step_dir(root: Location, step: int) -> Location:
    return root / checkpoint_dir_name(step)


def list_checkpoints(root: Location) -> list[CheckpointDir]:
    """Every `step-*` directory under `root`, oldest first."""
    found = []
    for child in root.children():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir:
            path = root / child.name
            committed = (path / CHECKPOINT_COMMITTED_MARKER).is_file()
            found.append(CheckpointDir(int(m.group(1)), path, committed))
    return sorted(found, key=lambda c: c.step)


def committed_newest_first(root: Location) -> list[CheckpointDir]:
    return [c for c in reversed(list_checkpoints(root)) if c.committed]


def write_marker(path: Location, meta: dict[str, Any]) -> None:
    """Write `COMMITTED` atomically, so a reader never sees half of it."""
    text = json.dumps(meta, sort_keys=True) + "\n"
    (path / CHECKPOINT_COMMITTED_MARKER).write_atomic(text.encode("utf-8"))


def read_marker(path: Location) -> dict[str, Any] | None:
    try:
        data = json.loads((path / CHECKPOINT_COMMITTED_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_commit_marker(path: Location) -> dict[str, Any]:
    """The `COMMITTED` marker of a step listed as committed, strictly: absent, empty or not a
    JSON object is damage (a marker that cannot be read vouches for nothing; before this, such
    a step loaded as if it were of the older, manifest-less format). Other I/O errors (a
    network, a throttled bucket) propagate: they say nothing about the checkpoint."""
    try:
        data = json.loads((path / CHECKPOINT_COMMITTED_MARKER).read_text())
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{path}: its {CHECKPOINT_COMMITTED_MARKER} is gone") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CorruptCheckpointError(
            f"{path}: unreadable {CHECKPOINT_COMMITTED_MARKER} marker ({e})"
        ) from e
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{path}: {CHECKPOINT_COMMITTED_MARKER} is not a record")
    return data


def check_marker_step(path: Location, marker: dict[str, Any], step: int) -> None:
    """The marker names the step of its directory: a step directory copied or synced under
    another step's name would resume with the step counter of one step and the sampler,
    schedule and weights of the other."""
    recorded = marker.get("step")
    if recorded is not None and recorded != step:
        raise CorruptCheckpointError(
            f"{path}: its {CHECKPOINT_COMMITTED_MARKER} marker is step {recorded}'s"
        )


def read_dcp_metadata(path: Location) -> Any:
    """DCP's `Metadata` of a checkpoint, through DCP's own storage reader (the one its load
    uses). Missing or not unpicklable is damage; other I/O errors propagate (transient)."""
    try:
        return path.dcp_reader().read_metadata()
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{path}: no {DCP_METADATA_FILE}") from e
    except OSError:
        raise
    except Exception as e:  # UnpicklingError, EOFError, ... on a garbled or empty file
        raise CorruptCheckpointError(f"{path}: unreadable DCP metadata ({e!r})") from e


def validate(
    path: Location, metadata: Any | None = None, sizes: dict[str, int] | None = None
) -> None:
    """Cheap structural check before loading: the DCP metadata unpickles and every byte range
    it points at exists. Catches truncated, missing and garbled files without touching the
    model; it cannot see flipped bits inside a tensor (DCP stores no checksums). `metadata`
    and `sizes` (the directory's listing): already read, so not read again."""
    if metadata is None:
        metadata = read_dcp_metadata(path)
    try:
        ends: dict[str, int] = {}
        for info in metadata.storage_data.values():
            end = int(info.offset) + int(info.length)
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
    except Exception as e:
        raise CorruptCheckpointError(f"{path}: unreadable DCP metadata ({e!r})") from e
    if sizes is None:
        sizes = path.sizes()  # one listing, not a request per file
    for rel, end in ends.items():
        size = sizes.get(rel, -1)
        if size < end:
            raise CorruptCheckpointError(f"{path}: {rel} has {size} bytes, metadata needs {end}")


def hash_file(path: Location, algorithm: str = HASH_ALGORITHM) -> str:
    if algorithm not in _HASHERS:
        raise CorruptCheckpointError(f"{path}: unknown manifest hash {algorithm!r}")
    h = _HASHERS[algorithm]()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return str(h.hexdigest())


def files_written_by(path: Location, rank: int) -> list[str]:
    """The checkpoint files one rank wrote: its `__<rank>_*.distcp`, and `.metadata` for the
    coordinator (rank 0)."""
    sizes = path.sizes()
    names = [n for n in sizes if (m := _RANK_FILE.match(n)) and int(m.group(1)) == rank]
    if rank == 0 and DCP_METADATA_FILE in sizes:
        names.append(DCP_METADATA_FILE)
    return sorted(names)


def describe_files(path: Location, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Manifest entries (size and hash) for files of one checkpoint directory. On an object
    store this reads back what the rank just uploaded: the hash is of what landed."""
    sizes = path.sizes()
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        out[name] = {"size": sizes.get(name, -1), HASH_ALGORITHM: hash_file(path / name)}
    return out


def manifest_of(marker: dict[str, Any] | None) -> dict[str, dict[str, Any]] | None:
    """The manifest a marker carries (None: a marker from before manifests existed)."""
    files = (marker or {}).get(MANIFEST_KEY)
    return files if isinstance(files, dict) and files else None


def verify_files(
    path: Location,
    manifest: dict[str, dict[str, Any]],
    names: Iterable[str],
    sizes: dict[str, int] | None = None,
) -> None:
    """Check the named manifest entries against the stored files: present, same size, same
    hash. Sizes (`sizes`: a listing already made, else one now) are checked before anything
    is hashed (cheap first)."""
    entries = [(n, manifest[n]) for n in names]
    if sizes is None:
        sizes = path.sizes()
    for name, entry in entries:
        size = sizes.get(name, -1)
        if size != entry.get("size"):
            raise CorruptCheckpointError(
                f"{path}: {name} has {size} bytes, the manifest says {entry.get('size')}"
            )
    for name, entry in entries:
        algorithm = next((a for a in _HASHERS if a in entry), None)
        if algorithm is None:
            raise CorruptCheckpointError(f"{path}: manifest entry {name} has no known hash")
        if hash_file(path / name, algorithm) != entry[algorithm]:
            raise CorruptCheckpointError(f"{path}: {name} does not match its {algorithm} hash")


def share_of(names: Iterable[str], rank: int, world_size: int) -> list[str]:
    """This rank's share of the files to verify: every rank checks a different slice, so a
    load verifies everything once, in parallel, whatever the world size was at save time."""
    return [n for i, n in enumerate(sorted(names)) if i % world_size == rank]


def _uncommit(path: Location) -> None:
    """Remove the marker first: a half-moved or half-deleted step must never look committed."""
    (path / CHECKPOINT_COMMITTED_MARKER).remove()


def quarantine(path: Location) -> Location:
    """Move a damaged checkpoint aside (see CORRUPT_SUFFIX); a previous one is replaced."""
    target = path.with_name(path.name + CORRUPT_SUFFIX)
    target.remove()
    _uncommit(path)
    path.move(target)
    return target


def cleanup_plan(checkpoints: list[CheckpointDir]) -> list[CheckpointDir]:
    """Pure: the uncommitted step directories the start-up cleanup may delete, from one
    listing (oldest first): only those older than the newest committed one. A step newer than
    every committed one is most often the save a crash cut short, but it may as well be the
    last save of the incarnation that just died, committed moments before by a rank 0 on
    another node: an NFS client's attribute or lookup cache can hide that marker from this
    node for up to `acdirmax`/`acregmax` (60 s by default). Deleting it would destroy the
    newest checkpoint for a lagging view; left alone it costs only its disk space until a
    save reaches its step again (it is rewritten, uncommitted first) or a commit passes it
    (the purge then deletes it, after a look at its marker)."""
    committed = [c.step for c in checkpoints if c.committed]
    if not committed:
        return []
    newest = max(committed)
    return [c for c in checkpoints if not c.committed and c.step < newest]


def deferred_plan(checkpoints: list[CheckpointDir]) -> list[CheckpointDir]:
    """Pure: the uncommitted step directories the start-up cleanup leaves for later (those
    `cleanup_plan` does not take): deleted by the first purge once the view has had time
    to catch up (`checkpoint_hygiene`, CLEANUP_GRACE_SECONDS), unless their marker opens then."""
    taken = {c.step for c in cleanup_plan(checkpoints)}
    return [c for c in checkpoints if not c.committed and c.step not in taken]


def marker_opens(path: Location) -> bool:
    """Whether the step's `COMMITTED` marker is there, asked by opening it: on NFS an open
    revalidates the lookup (close-to-open consistency) where the listing's `stat` may be
    answered from the attribute cache. Errors other than its absence propagate (unknown is
    not absent)."""
    try:
        with (path / CHECKPOINT_COMMITTED_MARKER).open("rb"):
            return True
    except FileNotFoundError:
        return False


def remove_partial(
    root: Location,
    failed: list[tuple[Location, OSError]] | None = None,
    spared: list[Location] | None = None,
    deferred: list[Location] | None = None,
) -> list[Location]:
    """Delete the uncommitted step directories `cleanup_plan` names (leftovers of saves that
    never finished), each after a second look at its marker by opening it: one found there
    after all is noted in `spared` and kept. Only safe while no save is in flight: at start,
    before anything is written. With `failed`, a directory that cannot be deleted is noted
    there and the others still are. `deferred`: where to note the steps left for later
    (`deferred_plan`), from the same listing."""
    removed = []
    listing = list_checkpoints(root)
    if deferred is not None:
        deferred.extend(c.path for c in deferred_plan(listing))
    for c in cleanup_plan(listing):
        try:
            if marker_opens(c.path):
                if spared is not None:
                    spared.append(c.path)
                continue
            c.path.remove()
        except OSError as e:
            if failed is None:
                raise
            failed.append((c.path, e))
            continue
        removed.append(c.path)
    return removed


def purge_plan(
    checkpoints: list[CheckpointDir], keep: int, *, below_step: int | None = None
) -> list[CheckpointDir]:
    """Pure: which of `checkpoints` (oldest first) a purge deletes. After committing
    `below_step`: the committed ones older than the newest `keep` of those up to it, and the
    uncommitted ones older than it. A committed step *newer* than `below_step` is never
    deleted nor counted: it is one a resume skipped (unreadable then) and the run has not
    reached again; counting it would delete the step just committed (keep 1) or the last one
    a run loaded, for a checkpoint nobody could read."""
    committed = [
        c for c in checkpoints if c.committed and (below_step is None or c.step <= below_step)
    ]
    doomed = committed[: max(0, len(committed) - keep)]
    if below_step is not None:
        doomed += [c for c in checkpoints if not c.committed and c.step < below_step]
    return doomed


# Damaged checkpoints moved aside (`step-N.corrupt`) kept for a post-mortem: the newest few.
KEEP_CORRUPT = 2
_CORRUPT_DIR = re.compile(
    re.escape(CHECKPOINT_STEP_PREFIX) + r"(\d{8,})" + re.escape(CORRUPT_SUFFIX) + r"$"
)


def corrupt_plan(
    steps: Iterable[int], newest_committed: int, keep: int = KEEP_CORRUPT
) -> list[int]:
    """Pure: which `step-N.corrupt` directories (by step) a purge deletes. The newest `keep`
    are kept for inspection; an older one goes once a newer checkpoint is committed (without
    one, the quarantined steps are the only evidence of what went wrong). Unbounded, a long
    job on a flaky volume would pile up a whole checkpoint per damaged step."""
    ordered = sorted(set(steps))
    older = ordered[: max(0, len(ordered) - keep)]
    return [s for s in older if s < newest_committed]


def corrupt_dirs(root: Location) -> dict[int, Location]:
    """The `step-N.corrupt` directories under `root`, by step."""
    found = {}
    for child in root.children():
        m = _CORRUPT_DIR.match(child.name)
        if m and child.is_dir:
            found[int(m.group(1))] = root / child.name
    return found


def purge(
    root: Location,
    keep: int,
    *,
    below_step: int | None = None,
    guard: Callable[[], None] | None = None,
) -> list[Location]:
    """Delete what `purge_plan` says: older committed checkpoints beyond `keep`, and
    uncommitted ones older than `below_step` (the step just committed; one whose marker
    opens after all is kept: see `cleanup_plan`); then the `step-N.corrupt` directories
    `corrupt_plan` names. `guard` runs before each step's delete and stops the purge by
    raising (a writer fenced meanwhile: checkpoint_fence): an uncommitted folder too, which
    may be a newer incarnation's save in flight."""
    doomed = purge_plan(list_checkpoints(root), keep, below_step=below_step)
    removed = []
    for c in doomed:
        if not c.committed and marker_opens(c.path):
            continue  # committed after all: the listing's view lagged
        if guard is not None:
            guard()
        _uncommit(c.path)
        c.path.remove()
        removed.append(c.path)
    if below_step is not None:
        quarantined = corrupt_dirs(root)
        for step in corrupt_plan(quarantined, below_step):
            quarantined[step].remove()
            removed.append(quarantined[step])
    return removed
