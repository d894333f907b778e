"""A dataset on object storage (`dataset.uri: s3://bucket/key`, a `*` glob allowed in the last
part; jsonl or parquet objects), fetched once per pod into its local data area and then read
like files on a volume.

Why a local copy rather than streaming: the tokenizer passes over the records once, but a pod
restarts (torchelastic) and re-reads them; and jsonl/parquet readers want seekable files.
The copy lives in the pod's data-cache emptyDir (`objects/`, beside the tokenized entries of
`cache.py`), so its bytes count against the volume's sizeLimit, which the pod requests as
ephemeral-storage: a corpus that does not fit is refused before a byte is downloaded (an
emptyDir over its sizeLimit gets the pod evicted).

Layout under `<data dir>/objects/`:

    <uri hash>.lock          flock: one local rank downloads, the others wait, then reuse
    <uri hash>/NNNNN-<name>  the objects, numbered in key order (the read order)
    <uri hash>/objects.json  written last: the identity of what was downloaded

The identity of an object is (URL, size, ETag, version id): the same key rewritten gets a new
ETag, so the copy is refreshed and the tokenized cache's key (which hashes the identity instead
of local paths and mtimes) changes: a changed corpus is never served from a stale cache."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import posixpath
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_operator.api.spec import DatasetSpec
from finetune_operator.api.storage import ObjectStoreSpec, is_object_store_uri
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.files import fsync_dir, remove, write_synced
from finetune_trainer.location import Location, access_problem, locate
from finetune_trainer.startup_progress import directory_bytes, phase

log = logging.getLogger(__name__)

OBJECTS_DIR = "objects"
MANIFEST = "objects.json"


def local_data_dir(configured: Path | None) -> Path:
    """Where fetched objects live: the pod's data-cache volume (FT_DATA_CACHE_DIR), else the
    temporary directory (a pod without the volume, a run outside one)."""
    return configured or Path(tempfile.gettempdir()) / "finetune-data"


@dataclass(frozen=True)
class RemoteObject:
    url: str
    size: int
    etag: str
    version: str | None

    def identity(self) -> list[Any]:
        return [self.url, self.size, self.etag, self.version]


@dataclass(frozen=True)
class StagedDataset:
    """A remote dataset's local copy: `spec` reads it (its uri is the copy's glob), `files`
    is the remote identity the tokenized cache keys on (cache_key.cache_key)."""

    spec: DatasetSpec
    files: list[list[Any]]


def local_names(objects: list[RemoteObject]) -> list[str]:
    """Pure: the local file names of the objects, numbered so that name order is key order
    (two keys may share a base name under different prefixes)."""
    return [f"{i:05d}-{posixpath.basename(o.url)}" for i, o in enumerate(objects)]


def fits(objects: list[RemoteObject], budget: int | None) -> bool:
    """Pure: whether the objects fit the bytes the data area may still take (None: no limit)."""
    return budget is None or sum(o.size for o in objects) <= budget


def remote_object(url: str, info: dict[str, Any]) -> RemoteObject:
    """Pure: an object's identity from its listing (fsspec `info`)."""
    return RemoteObject(
        url=url,
        size=int(info.get("size") or 0),
        etag=str(info.get("ETag") or info.get("etag") or "").strip('"'),
        version=info.get("VersionId"),
    )


def _refusal(spec: DatasetSpec, problem: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"dataset.uri {spec.uri!r}: {problem}")


def list_objects(spec: DatasetSpec, pattern: Location) -> list[RemoteObject]:
    """The objects the URI names, in key order; none is a configuration error naming it."""
    fs = pattern.fs
    try:
        if "*" in pattern.name:
            infos = dict(fs.glob(pattern.path, detail=True))
        else:
            infos = {pattern.path: fs.info(pattern.path)}
    except OSError as e:
        problem = access_problem(e)
        if problem is None:
            raise  # the network, throttling, expired credentials: a restart may pass
        raise _refusal(spec, problem) from e
    objects = [
        remote_object(str(fs.unstrip_protocol(path)), info)
        for path, info in sorted(infos.items())
        if info.get("type") != "directory"
    ]
    if not objects:
        raise _refusal(spec, "no such object")
    return objects


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _intact(directory: Path, objects: list[RemoteObject]) -> bool:
    """Whether the copy in `directory` is of exactly these objects, complete."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest != [o.identity() for o in objects]:
        return False
    for name, obj in zip(local_names(objects), objects, strict=True):
        path = directory / name
        if not path.is_file() or path.stat().st_size != obj.size:
            return False
    return True


def download(spec: DatasetSpec, source: Location, obj: RemoteObject, target: Path) -> None:
    """One object to `target`, through a temporary name: complete, or not there at all."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        source.fs.get_file(source.fs._strip_protocol(obj.url), str(tmp))
    except FileNotFoundError as e:
        remove(tmp)
        # Listed a moment ago (by this rank or rank 0): deleted or replaced since, a race a
        # restart's listing settles (it refuses a URI that names nothing any more).
        raise OSError(f"dataset.uri {spec.uri!r}: {obj.url} was listed but is gone") from e
    except OSError as e:
        remove(tmp)
        problem = access_problem(e)
        if problem:
            raise _refusal(spec, f"{obj.url}: {problem}") from e
        raise
    got = tmp.stat().st_size
    if got != obj.size:
        remove(tmp)
        # Not a refusal: a broken connection or an object replaced meanwhile; a restart
        # downloads it again.
        raise OSError(
            f"dataset.uri {spec.uri!r}: {obj.url} downloaded {got} of {obj.size} "
            "bytes (truncated, or the object changed while downloading)"
        )
    # The bytes are whatever the key held while they were read (s3fs fetches a large object
    # in concurrent ranges): rewritten since the listing, even to the same size, they are not
    # the listed object, and the tokenized cache would key them on the listed ETag, serving
    # them for it ever after. Asked again after the download: the same identity, or a
    # restart lists and fetches anew.
    path = source.fs._strip_protocol(obj.url)
    try:
        now = remote_object(obj.url, source.fs.info(path))
    except OSError:
        remove(tmp)
        raise
    # Size and ETag: a listing (ListObjectsV2) gives no version id where a HEAD may.
    if (now.size, now.etag) != (obj.size, obj.etag):
        remove(tmp)
        raise OSError(f"dataset.uri {spec.uri!r}: {obj.url} changed while downloading "
                      f"(ETag {obj.etag} listed, {now.etag} now)")  # fmt: skip
    os.replace(tmp, target)


def used_bytes(path: Path) -> int:
    """What the data area holds now: the corpus's copy (`objects/`), the tokenized blocks and
    a remote model's config and tokenizer files (`models/`, finetune_trainer.remote_model)
    alike, so that each budget check counts the others'."""
    if not path.is_dir():
        return 0
    # The other local ranks write, rename and remove in this area while it is walked (a
    # staging directory renamed into place): what vanished meanwhile is not counted, where
    # `rglob` raised FileNotFoundError and failed the rank's start.
    total = 0
    for root, _, files in os.walk(path):  # errors (a directory gone) are skipped
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(os.path.join(root, name))
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def _evict_others(objects_dir: Path, keep: str) -> None:
    """Remove the copies of other URIs that no local rank is fetching now."""
    for lock in objects_dir.glob("*.lock"):
        other = lock.name.removesuffix(".lock")
        if other == keep:
            continue
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            try:
                remove(objects_dir / other)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def stage_dataset(
    spec: DatasetSpec,
    store: ObjectStoreSpec | None,
    data_dir: Path | None,
    limit_bytes: int | None = None,
    agree: Callable[[list[RemoteObject]], list[RemoteObject]] | None = None,
) -> StagedDataset | None:
    """The local copy of an s3:// dataset, fetched if this pod has none of these exact
    objects (None: not on object storage). `data_dir`: the pod's data-cache volume (None:
    the temporary directory); `limit_bytes`: what it may hold in all (the data cache's
    budget), checked before downloading; `agree`: this rank's listing in, the one every rank
    uses out (rank 0's, broadcast): ranks that listed either side of a rewrite would
    otherwise tokenize different corpora (another length, another step count: a hang), and a
    local rank would replace the copy another one is reading."""
    if not is_object_store_uri(spec.uri):
        return None
    if spec.format not in ("jsonl", "parquet"):  # refused at plan time too (api/storage.py)
        raise _refusal(spec, f"format {spec.format} is not read from object storage; use "
                             "jsonl or parquet objects")  # fmt: skip
    data_dir = local_data_dir(data_dir)
    pattern = locate(spec.uri, "dataset.uri", object_store=store)
    objects = list_objects(spec, pattern)
    if agree is not None:
        # A collective, bounded by its own timeout: not judged by progress (startup_progress).
        with phase("dataset listing (rank 0's, broadcast)", extra_s=math.inf):
            objects = agree(objects)
    objects_dir = data_dir / OBJECTS_DIR
    objects_dir.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(spec.uri.encode()).hexdigest()[:16]
    directory = objects_dir / name
    # Progress: the bytes under the pod's copies, partial files included (s3fs writes as it
    # reads), whether this rank downloads or waits on the lock for a local rank that does.
    progress = phase("dataset download", probe=lambda: directory_bytes(objects_dir))
    with progress, _locked(objects_dir / f"{name}.lock"):
        if _intact(directory, objects):
            log.info("dataset %s: the pod's copy is current (%d objects)", spec.uri, len(objects))
        else:
            remove(directory)
            _evict_others(objects_dir, name)
            budget = None if limit_bytes is None else limit_bytes - used_bytes(data_dir)
            if not fits(objects, budget):
                total = sum(o.size for o in objects)
                raise _refusal(spec, (
                    f"the objects take {total} bytes, more than the {budget} the pod's data "
                    "area has left: raise dataset.cacheSizeLimit (it holds the downloaded "
                    "corpus and its tokenized blocks)"
                ))  # fmt: skip
            directory.mkdir()
            for filename, obj in zip(local_names(objects), objects, strict=True):
                download(spec, pattern, obj, directory / filename)
            write_synced(directory / MANIFEST, json.dumps([o.identity() for o in objects]).encode())
            fsync_dir(directory)
            log.info("dataset %s: fetched %d objects, %d bytes", spec.uri, len(objects),
                     sum(o.size for o in objects))  # fmt: skip
    copy = spec.model_copy(update={"uri": str(directory / "[0-9]*")})
    return StagedDataset(spec=copy, files=[o.identity() for o in objects])
