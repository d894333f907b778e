"""Where checkpoints and the exported model live (and where a dataset or pretrained weights are
read from): a directory on a local (or mounted) filesystem or a prefix in object storage
(`s3://bucket/prefix`), behind one small interface over fsspec.

The checkpoint store, the ownership records and the exporter use only this interface, so one
code path serves both. The two kinds differ in two ways that matter, handled here and nowhere
else:

- Atomic replacement. A local file is written to a temp name and renamed over the target; an
  object store has no rename, but a single PUT is atomic (a reader sees the old object or the
  new one, never half), so small records are put directly.
- Directories. An object store has only keys: a "directory" exists while a key lies under it,
  making one is a no-op, and moving one is a server-side copy of each object then a delete.

Listings are never cached (`use_listings_cache=False`): other ranks and other pods write the
same prefix, and a stale listing would hide their files.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from finetune_operator.api.storage import OBJECT_STORE_SCHEME, ObjectStoreSpec
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.files import fsync_dir, write_synced


@dataclass(frozen=True)
class Entry:
    """One child of a directory listing."""

    name: str
    size: int
    is_dir: bool


def storage_options(store: ObjectStoreSpec | None) -> dict[str, Any]:
    """s3fs options from `spec.storage.objectStore`. Credentials are not among them: the
    client reads AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY from the environment, which the
    kubelet fills from the job's Secret."""
    client: dict[str, Any] = {}
    config: dict[str, Any] = {}
    if store is not None:
        if store.endpoint_url:
            client["endpoint_url"] = store.endpoint_url
        if store.region:
            client["region_name"] = store.region
        if store.path_style:
            config["s3"] = {"addressing_style": "path"}
    options: dict[str, Any] = {"use_listings_cache": False}
    if client:
        options["client_kwargs"] = client
    if config:
        options["config_kwargs"] = config
    return options


class Location:
    """A directory (or a file in one) on a filesystem fsspec knows."""

    def __init__(self, fs: AbstractFileSystem, path: str, options: Mapping[str, Any]) -> None:
        self.fs = fs
        self.path = path.rstrip("/") or "/"
        self.options = dict(options)

    # ---- naming -----------------------------------------------------------------------------

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def url(self) -> str:
        """What a user reads in messages: a plain path, or `s3://bucket/key`."""
        return self.path if self.is_local else str(self.fs.unstrip_protocol(self.path))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> Location:
        return Location(self.fs, posixpath.dirname(self.path), self.options)

    def __truediv__(self, name: str) -> Location:
        return Location(self.fs, posixpath.join(self.path, name), self.options)

    def with_name(self, name: str) -> Location:
        return self.parent / name

    @property
    def local_path(self) -> Path:
        """The path of a local location (for code that needs a real directory)."""
        if not self.is_local:
            raise ValueError(f"{self.url} is not on a local filesystem")
        return Path(self.path)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Location({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and (self.url, self.is_local) == (
            other.url,
            other.is_local,
        )

    def __hash__(self) -> int:
        return hash(self.url)

    # ---- reading ----------------------------------------------------------------------------

    def exists(self) -> bool:
        return bool(self.fs.exists(self.path))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.path))

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.path))

    def children(self) -> list[Entry]:
        """The directory's entries in one listing (sizes included); empty if it is absent."""
        try:
            listed = self.fs.ls(self.path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for info in listed:
            name = posixpath.basename(str(info["name"]).rstrip("/"))
            if name and str(info["name"]).rstrip("/") != self.path:
                out.append(Entry(name, int(info.get("size") or 0), info.get("type") == "directory"))
        return out

    def sizes(self) -> dict[str, int]:
        """Size of every file directly in the directory, by name."""
        return {e.name: e.size for e in self.children() if not e.is_dir}

    @contextlib.contextmanager
    def open(self, mode: str = "rb") -> Iterator[IO[bytes]]:
        with self.fs.open(self.path, mode) as f:
            yield f

    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.path))

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    # ---- writing ----------------------------------------------------------------------------

    def makedirs(self) -> None:
        """Create the directory (a no-op on object stores, which have no directories: never
        create a bucket as a side effect)."""
        if self.is_local:
            self.fs.makedirs(self.path, exist_ok=True)

    def write_atomic(self, data: bytes, *, tmp_tag: str = "") -> None:
        """Replace the file as a whole: readers see the old content or the new, never part."""
        if not self.is_local:
            self.fs.pipe_file(self.path, data)  # one PUT
            return
        self.parent.makedirs()
        tmp = self.with_name(f".{self.name}{tmp_tag}.tmp").path
        # On disk before the rename: a crash (a node lost) must not leave the new name over
        # an empty file (delayed allocation; a COMMITTED marker vouching for nothing).
        write_synced(Path(tmp), data)
        os.replace(tmp, self.path)
        # The rename on disk too before the caller goes on (a commit reported, older steps
        # purged): it lives in the directory, which only the directory's fsync makes durable.
        # A filesystem that cannot open or sync a directory (some FUSE and network mounts
        # refuse) keeps the rename's own ordering.
        with contextlib.suppress(OSError):
            fsync_dir(Path(os.path.dirname(self.path)))

    def upload(self, source: Path) -> None:
        """Copy a local file here."""
        self.parent.makedirs()
        self.fs.put_file(str(source), self.path)

    def remove(self) -> None:
        """Delete the file or the whole directory; absent is fine."""
        with contextlib.suppress(FileNotFoundError):
            if self.fs.isdir(self.path):
                self.fs.rm(self.path, recursive=True)
            elif self.fs.exists(self.path):
                self.fs.rm_file(self.path)

    def move(self, target: Location) -> None:
        """Move a directory: a rename locally; a copy of each object and a delete in an
        object store (not atomic: callers make the source invisible first)."""
        if self.is_local:
            os.replace(self.path, target.path)
        else:
            # Object by object (a server-side copy each), then the source as a whole.
            for key in self.fs.find(self.path):
                rel = posixpath.relpath(str(key), self.path)
                self.fs.copy(str(key), posixpath.join(target.path, rel))
            self.fs.rm(self.path, recursive=True)

    # ---- DCP --------------------------------------------------------------------------------

    def dcp_writer(self) -> Any:
        """DCP's storage writer for this directory: its own os-based writer on a local
        filesystem (measured ~20% faster there than the fsspec one: 0.72 s against 0.88 s for
        256 MiB), DCP's fsspec writer on an object store, without fsync (an object is durable
        once its upload completes; for a file object without a descriptor DCP would fall
        back to os.sync() of the whole machine)."""
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        if self.is_local:
            return FileSystemWriter(self.path)
        return FsspecWriter(self.url, sync_files=False, **self.options)

    def dcp_reader(self) -> Any:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        if self.is_local:
            return FileSystemReader(self.path)
        return FsspecReader(self.url, **self.options)


# Codes (and server messages) of credentials that have expired rather than been refused: a
# rotated Secret or a refreshed IRSA token is read again by the restarted pod.
EXPIRED_CODES = frozenset(
    {"ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired", "RequestExpired"}
)
EXPIRED_TEXTS = (
    "token has expired",
    "token is expired",
    "token included in the request is expired",
)


def error_code(exc: BaseException) -> str | None:
    """The S3 error code behind an s3fs error (its cause is botocore's ClientError)."""
    for e in (exc, exc.__cause__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
    return None


def credentials_expired(code: str | None, text: str) -> bool:
    """Pure: whether an error (its S3 code, when known, and its text) says the credentials
    expired: transient, unlike a denial (s3fs maps ExpiredToken to PermissionError too)."""
    if code in EXPIRED_CODES or any(c in text for c in EXPIRED_CODES):
        return True
    lowered = text.lower()
    return any(t in lowered for t in EXPIRED_TEXTS)


def access_problem(exc: BaseException) -> str | None:
    """What a read's error means to the user, for the errors that are the job's configuration
    (s3fs turns NoSuchBucket/NoSuchKey into FileNotFoundError, AccessDenied, a bad key or
    signature into PermissionError); None for the others (network, throttling, expired
    credentials: transient, a restarted pod reads the Secret or its token again)."""
    if isinstance(exc, FileNotFoundError):
        return "no such bucket or object"
    if isinstance(exc, PermissionError):
        if credentials_expired(error_code(exc), str(exc)):
            return None
        return (
            "access denied (check the keys in the Secret storage.objectStore.secretName names, "
            "or the pod's own role, against the bucket's policy)"
        )
    return None


def locate(
    uri: str, field: str, *, cwd: Path | None = None, object_store: ObjectStoreSpec | None = None
) -> Location:
    """A checkpoint or output URI as a Location: a path or file:// URI (relative paths resolve
    against the working directory), or s3://bucket/prefix. Other schemes are refused naming
    the field (the operator refuses them at plan time too: api/storage.py)."""
    if uri.startswith("file://"):
        uri = uri.removeprefix("file://")
    if "://" not in uri:
        path = Path(uri)
        path = path if path.is_absolute() else (cwd or Path.cwd()) / path
        return Location(LocalFileSystem(), str(path), {})
    if not uri.startswith(OBJECT_STORE_SCHEME):
        raise UnsupportedConfigError(
            f"{field} {uri!r}: only s3:// object storage (or a path on a volume) is supported"
        )
    options = storage_options(object_store)
    try:
        fs, path = url_to_fs(uri, **options)
    except ImportError as e:
        raise UnsupportedConfigError(f"{field} {uri!r}: s3fs is not installed ({e})") from e
    return Location(fs, str(path), options)
