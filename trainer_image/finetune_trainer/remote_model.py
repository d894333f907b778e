"""A pretrained model under an object-store prefix (`model.source: uri`, `model.path:
s3://bucket/prefix`): its small files fetched, its weights left where they are.

config.json, the tokenizer's files and the generation config are what transformers needs as
a directory: they are fetched into the pod's data-cache volume (`RuntimeEnv.data_cache_dir`,
the emptyDir the dataset and the tokenized cache use; the temporary directory without one), not
into /tmp: a worker that is SIGKILLed or OOM-killed runs no atexit hook, and its files would
pile up there at every restart (on a read-only root, /tmp may not even be writable).

Layout under `<data dir>/models/`: `<url hash>-<identity hash>/`, the identity being every
fetched object's (URL, size, ETag, version id), so a restart that lists the same objects
reuses the directory without fetching, and a rewritten config gets a new directory (the old
ones of the prefix are removed). They count against the data area's budget
(`dataset.cacheSizeLimit`) like the corpus and the tokenized blocks: fetched only if they fit
what is left, and counted by the checks that come after them. Each rank fetches into a staging directory of its own and
renames it into place when complete: a killed fetch never leaves a directory that is used,
and ranks racing to fetch never wait on one another. The safetensors are not fetched: they are
read by byte ranges straight into each rank's shards (finetune_trainer.safetensors_ranges)."""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import logging
import os
import uuid
from pathlib import Path

from finetune_operator.api.spec import ModelSpec
from finetune_operator.api.storage import ObjectStoreSpec, is_object_store_uri
from finetune_trainer.data.remote import (
    RemoteObject,
    local_data_dir,
    remote_object,
    used_bytes,
)
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.files import fsync_dir, remove, write_synced
from finetune_trainer.location import Location, access_problem, locate

log = logging.getLogger(__name__)

# What transformers reads of a model directory besides the weights (the hub download's
# allow-list, plus chat templates and tiktoken vocabularies kept as their own files).
SMALL_FILES = ("*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken")
# A "small" file bigger than this is not a config or tokenizer: refused, not fetched.
MAX_SMALL_FILE_BYTES = 512 << 20
MODELS_DIR = "models"
STAGING = ".staging-"


def weights_field(spec: ModelSpec) -> str:
    return "spec.model.path" if spec.path else "spec.model.name"


def remote_weights(spec: ModelSpec, store: ObjectStoreSpec | None) -> Location | None:
    """The object-store prefix of a pretrained model, None for a path, a hub id or inline."""
    uri = spec.weights_location()
    if uri is None or spec.source != "uri" or not is_object_store_uri(uri):
        return None
    return locate(uri, weights_field(spec), object_store=store)


def small_file_names(names: list[str]) -> list[str]:
    """Pure: which entries of the model's prefix are fetched (configs and tokenizer files)."""
    return sorted(n for n in names if any(fnmatch.fnmatch(n, p) for p in SMALL_FILES))


def cache_root(data_cache_dir: Path | None) -> Path:
    """Where fetched model files live: the pod's data-cache volume (`RuntimeEnv.data_cache_dir`,
    the worker pod's `data-cache` emptyDir), else the temporary directory (as the dataset's
    copy, data/remote.py)."""
    return local_data_dir(data_cache_dir) / MODELS_DIR


def cache_limit(env: dict[str, str] | None = None) -> int | None:
    """The data area's budget (FT_DATA_CACHE_LIMIT_BYTES: the worker pod's data-cache
    sizeLimit less a margin, resources/worker.py); None without one."""
    raw = (os.environ if env is None else env).get("FT_DATA_CACHE_LIMIT_BYTES")
    return int(raw) if raw else None


def cache_name(url: str, objects: list[RemoteObject]) -> str:
    """Pure: the directory of these objects of the prefix `url`: its URL's hash, then the
    hash of the objects' identities (a rewritten object, even of the same size, changes it)."""
    prefix = hashlib.sha256(url.encode()).hexdigest()[:16]
    identity = json.dumps([o.identity() for o in objects]).encode()
    return f"{prefix}-{hashlib.sha256(identity).hexdigest()[:16]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(root: Path, name: str) -> None:
    """Remove this prefix's older copies, and staging directories of processes that are
    gone (a fetch killed part way); a live rank's staging directory is left alone."""
    prefix = name.split("-")[0]
    for path in root.iterdir():
        if path.name.startswith(STAGING):
            pid = path.name.removeprefix(STAGING).split("-")[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                remove(path)
        elif path.name.startswith(f"{prefix}-") and path.name != name:
            remove(path)


def _counted_copies(root: Path, directory: Path) -> int:
    """The bytes of the other local ranks' copies of these files already on disk (their
    staging directories, or the copy one of them renamed into place since): `need` counts
    every local rank's copy, so the data area's use must not count them again (a budget
    that fits them all was refused while a peer was part way through its fetch)."""
    return sum(used_bytes(p) for p in root.glob(f"{STAGING}*")) + used_bytes(directory)


def _listing(location: Location, field: str) -> dict[str, RemoteObject]:
    fs = location.fs
    try:
        infos = fs.ls(location.path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return {}  # refused below: no config.json there
    except OSError as e:
        problem = access_problem(e)
        if problem is None:
            raise  # the network, throttling, expired credentials: a restart may pass
        raise UnsupportedConfigError(f"{field} {location.url!r}: {problem}") from e
    out: dict[str, RemoteObject] = {}
    for info in infos:
        key = str(info["name"]).rstrip("/")
        name = key.rsplit("/", 1)[-1]
        if info.get("type") != "directory" and key != location.path and name:
            out[name] = remote_object(str(fs.unstrip_protocol(key)), info)
    return out


@functools.cache
def model_files(
    location: Location, field: str = "spec.model.path", cache_dir: Path | None = None
) -> Path:
    """A local directory with the model's config and tokenizer files, fetched once per pod
    (and kept for its restarts) under `cache_root(cache_dir)` (`cache_dir`: the pod's data
    cache, `RuntimeEnv.data_cache_dir`). A missing prefix, no config.json or denied access is
    a configuration error naming the URI."""
    listed = _listing(location, field)
    names = small_file_names(list(listed))
    if "config.json" not in names:
        raise UnsupportedConfigError(
            f"{field} {location.url!r}: no config.json there (a Hugging Face model "
            "directory as save_pretrained writes it: config.json, tokenizer files, "
            "*.safetensors)"
        )
    too_big = [n for n in names if listed[n].size > MAX_SMALL_FILE_BYTES]
    if too_big:
        raise UnsupportedConfigError(
            f"{field} {location.url!r}: {too_big} are over "
            f"{MAX_SMALL_FILE_BYTES >> 20} MiB: not config or tokenizer files"
        )
    objects = [listed[n] for n in names]
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    directory = root / cache_name(location.url, objects)
    if directory.is_dir():
        log.info("model files %s: the pod's copy is current (%s)", location.url, directory)
        return directory
    _remove_stale(root, directory.name)
    limit = cache_limit()
    # The files count against dataset.cacheSizeLimit like the corpus and the tokenized
    # blocks (each check walks the whole data area): a tokenizer of tens of MB in a small
    # cache would otherwise overrun the emptyDir's sizeLimit, and the kubelet evicts the pod.
    # Every local rank may be staging its own copy at once (one survives the renames).
    copies = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    budget = (
        None
        if limit is None
        else limit - used_bytes(root.parent) + _counted_copies(root, directory)
    )
    need = copies * sum(o.size for o in objects)
    if budget is not None and need > budget:
        raise UnsupportedConfigError(
            f"{field} {location.url!r}: the config and tokenizer files take "
            f"{need} bytes ({copies} local ranks' copies while fetching), more than the "
            f"{budget} the pod's data area has left: raise dataset.cacheSizeLimit (it holds "
            "these files, the downloaded corpus and its tokenized blocks)"
        )
    staging = root / f"{STAGING}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        for name in names:
            _fetch(location / name, listed[name], staging / name, field)
        fsync_dir(staging)
        try:
            os.rename(staging, directory)  # complete, or not there at all
        except OSError:
            if not directory.is_dir():
                raise
            # Another rank of the pod renamed the same objects into place first.
        fsync_dir(root)
    finally:
        remove(staging)
    log.info("model files %s fetched from %s", names, location.url)
    return directory


def _fetch(source: Location, obj: RemoteObject, target: Path, field: str) -> None:
    try:
        data = source.read_bytes()
    except OSError as e:
        problem = access_problem(e)
        if problem is None:
            raise
        raise UnsupportedConfigError(f"{field} {source.url!r}: {problem}") from e
    if len(data) != obj.size:
        raise OSError(f"{source.url}: read {len(data)} bytes of {obj.size} (truncated)")
    write_synced(target, data)
