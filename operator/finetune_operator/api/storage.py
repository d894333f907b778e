"""Storage the workers mount: PersistentVolumeClaims by name (the shorthand) and the general
Kubernetes `volumes`/`volumeMounts` shapes, and the rule that every absolute path the job reads
or writes lies on one of them.

The root filesystem of a worker is read-only and its /tmp dies with the pod, so checkpoints,
the exported model, the dataset and pretrained weights live on a declared volume (or, for
relative paths, under the container's working directory, which only the local cluster shares
between pods). Checkpoints and output are written by every worker: their claim must be
ReadWriteMany (NFS, CephFS, Filestore, EFS, Azure Files...).

Checkpoints and the exported model may instead go to object storage (`s3://bucket/prefix`: AWS
S3 or an S3-compatible store) described by `storage.objectStore`, and the dataset (jsonl or
parquet objects) and pretrained weights (`model.source: uri`) may be read from it; its
credentials stay in a Secret the job names, which the kubelet turns into the workers'
environment."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator, model_validator

from finetune_operator.api import limits as lim
from finetune_operator.api.base import SpecModel
from finetune_operator.api.constants import DATA_CACHE_MOUNT_DIR

if TYPE_CHECKING:
    from finetune_operator.api.spec import FineTuneJobSpec

# Paths the worker pod builder mounts itself (resources/worker.py): a user volume may not
# shadow them or sit inside them.
RESERVED_MOUNTS = (
    "/etc/finetune",
    "/dev/shm",
    "/tmp",
    "/dev/termination-log",
    DATA_CACHE_MOUNT_DIR,
)
CLAIM_VOLUME_PREFIX = "claim-"

# The keys of storage.objectStore.secretName, under the names every S3 client reads from the
# environment; the session token is optional (temporary credentials).
SECRET_KEYS_REQUIRED = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
SECRET_KEYS_OPTIONAL = ("AWS_SESSION_TOKEN",)
OBJECT_STORE_SCHEME = "s3://"
# Written fields that may name an object store; the dataset and the weights of a model of
# source uri are read from one (object_store_uris).
_OBJECT_STORE_FIELDS = ("checkpoint", "output")
# Schemes that are not object stores: a path, or a dataset shipped in the trainer image.
_NOT_OBJECT_STORES = ("file", "builtin")


class ClaimMount(SpecModel):
    """Shorthand: mount a PersistentVolumeClaim of the job's namespace into every worker."""

    claim_name: str = Field(
        ..., min_length=1, max_length=lim.MAX_NAME_LENGTH, description="PersistentVolumeClaim name."
    )
    mount_path: str = Field(
        ...,
        min_length=1,
        max_length=lim.MAX_URI_LENGTH,
        description="Absolute path in the workers.",
    )
    read_only: bool = Field(False, description="Mount read-only (weights, datasets).")
    sub_path: str | None = Field(
        None, max_length=lim.MAX_URI_LENGTH, description="Mount only this directory of the volume."
    )


class VolumeMount(SpecModel):
    """A core/v1 VolumeMount of the trainer container."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=lim.MAX_SHORT_STRING,
        description="A volume of storage.volumes.",
    )
    mount_path: str = Field(
        ...,
        min_length=1,
        max_length=lim.MAX_URI_LENGTH,
        description="Absolute path in the workers.",
    )
    read_only: bool = Field(False, description="Mount read-only.")
    sub_path: str | None = Field(
        None, max_length=lim.MAX_URI_LENGTH, description="Mount only this path of the volume."
    )


class ObjectStoreSpec(SpecModel):
    """Where the job's s3:// URIs (checkpoint, output, dataset, model path) live, and the
    Secret with the keys."""

    secret_name: str | None = Field(
        None,
        min_length=1,
        max_length=lim.MAX_NAME_LENGTH,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description=(
            "Secret in the job's namespace with the keys AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN optional), given to the workers as "
            "environment variables; a worker does not start while it or a key is missing. "
            "Omitted: the pod's own credentials (IAM roles for service accounts, EKS Pod "
            "Identity, an instance profile)."
        ),
    )
    endpoint_url: str | None = Field(
        None,
        max_length=lim.MAX_URI_LENGTH,
        pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$",
        description=(
            "The S3 API endpoint of an S3-compatible store (MinIO, Ceph RGW, the GCS XML API "
            "at https://storage.googleapis.com with HMAC keys); omitted: AWS S3."
        ),
    )
    region: str | None = Field(
        None,
        min_length=1,
        max_length=lim.MAX_SHORT_STRING,
        pattern=r"^[a-z0-9-]+$",
        description="Region of the bucket (e.g. us-east-1); omitted: the client's default.",
    )
    path_style: bool = Field(
        False,
        description=(
            "Address buckets as <endpoint>/<bucket> instead of <bucket>.<endpoint> (MinIO and "
            "most S3-compatible stores need it)."
        ),
    )


class StorageSpec(SpecModel):
    object_store: ObjectStoreSpec | None = Field(
        None,
        description=(
            "Object storage for s3:// checkpoint.uri, output.uri, dataset.uri and model.path: "
            "endpoint, region and the Secret holding the credentials (never in the spec)."
        ),
    )
    claims: list[ClaimMount] = Field(
        default_factory=list,
        max_length=lim.MAX_LIST_ITEMS,
        description=(
            "PersistentVolumeClaims to mount into every worker (ReadWriteMany for checkpoints "
            "and output, which every worker writes)."
        ),
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=lim.MAX_LIST_ITEMS,
        description="core/v1 Volumes of the worker pods (as in a pod spec), each with a name.",
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        max_length=lim.MAX_LIST_ITEMS,
        description="core/v1 VolumeMounts of the trainer container, naming storage.volumes.",
    )

    @field_validator("volumes")
    @classmethod
    def _named(cls, volumes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, volume in enumerate(volumes):
            name = volume.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(f"storage.volumes[{i}] needs a name")
            if name.startswith(CLAIM_VOLUME_PREFIX):
                raise ValueError(
                    f"storage.volumes[{i}].name {name!r}: the prefix {CLAIM_VOLUME_PREFIX!r} is "
                    "reserved for storage.claims"
                )
        return volumes

    @model_validator(mode="after")
    def _consistent(self) -> StorageSpec:
        names = [str(v["name"]) for v in self.volumes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"storage.volumes: duplicate names {dupes}")
        for i, mount in enumerate(self.volume_mounts):
            if mount.name not in names:
                raise ValueError(
                    f"storage.volumeMounts[{i}].name {mount.name!r} is not in storage.volumes"
                )
        paths = [("claims", i, c.mount_path) for i, c in enumerate(self.claims)] + [
            ("volumeMounts", i, m.mount_path) for i, m in enumerate(self.volume_mounts)
        ]
        seen: dict[str, str] = {}
        for field, i, path in paths:
            where = f"storage.{field}[{i}].mountPath"
            problem = mount_path_problem(path)
            if problem:
                raise ValueError(f"{where} {path!r}: {problem}")
            if path.rstrip("/") in seen:
                raise ValueError(f"{where} {path!r} is also {seen[path.rstrip('/')]}")
            seen[path.rstrip("/")] = where
        return self

    def mounts(self) -> list[tuple[str, dict[str, Any]]]:
        """(mount path, core/v1 VolumeMount) of every declared mount, claims first."""
        out: list[tuple[str, dict[str, Any]]] = []
        for i, claim in enumerate(self.claims):
            mount: dict[str, Any] = {
                "name": claim_volume_name(i),
                "mountPath": claim.mount_path,
                "readOnly": claim.read_only,
            }
            if claim.sub_path:
                mount["subPath"] = claim.sub_path
            out.append((claim.mount_path, mount))
        out += [(m.mount_path, m.to_json_dict()) for m in self.volume_mounts]
        return out

    def pod_volumes(self) -> list[dict[str, Any]]:
        """The core/v1 Volumes of the worker pod: one per claim, then storage.volumes."""
        claims = [
            {
                "name": claim_volume_name(i),
                "persistentVolumeClaim": {"claimName": c.claim_name, "readOnly": c.read_only},
            }
            for i, c in enumerate(self.claims)
        ]
        return claims + [dict(v) for v in self.volumes]


def claim_volume_name(index: int) -> str:
    return f"{CLAIM_VOLUME_PREFIX}{index}"


def mount_path_problem(path: str) -> str | None:
    p = PurePosixPath(path)
    if not p.is_absolute():
        return "must be an absolute path"
    if ".." in p.parts:
        return "must not contain '..'"
    if p == PurePosixPath("/"):
        return "cannot be the root directory"
    for reserved in RESERVED_MOUNTS:
        r = PurePosixPath(reserved)
        if p == r or r in p.parents or p in r.parents:
            return f"overlaps {reserved}, which the worker pod mounts itself"
    return None


def local_path(uri: str) -> str | None:
    """The filesystem path a URI names in a worker (file:// or a plain path), else None
    (object stores, hub ids, builtin://)."""
    if uri.startswith("file://"):
        return uri.removeprefix("file://")
    if "://" in uri:
        return None
    return uri


def mount_for(path: str, storage: StorageSpec) -> tuple[str, bool] | None:
    """(mount path, read-only) of the declared mount `path` lies under, the deepest one."""
    p = PurePosixPath(path)
    best: tuple[str, bool] | None = None
    for mount_path, mount in storage.mounts():
        m = PurePosixPath(mount_path)
        if (p == m or m in p.parents) and (best is None or len(mount_path) > len(best[0])):
            best = (mount_path, bool(mount.get("readOnly", False)))
    return best


def unmounted_paths(spec: FineTuneJobSpec) -> list[tuple[str, str]]:
    """(field, reason) for each absolute path of the job that lies on no declared mount, or
    that the job writes through a read-only one. Relative paths resolve against the working
    directory and are not confined here; object-store URIs are not paths."""
    paths: list[tuple[str, str, bool]] = [
        ("spec.checkpoint.uri", spec.checkpoint.uri, True),
        ("spec.output.uri", spec.output.uri or "", True),
        ("spec.dataset.uri", spec.dataset.uri, False),
    ]
    if spec.model.source in ("pvc", "uri"):
        field = "spec.model.path" if spec.model.path else "spec.model.name"
        paths.append((field, spec.model.weights_location() or "", False))
    problems: list[tuple[str, str]] = []
    for field, uri, written in paths:
        path = local_path(uri)
        if path is None or not path.startswith("/"):
            continue
        found = mount_for(path, spec.storage)
        if found is None:
            declared = [m for m, _ in spec.storage.mounts()] or "none"
            problems.append(
                (
                    field,
                    (
                        f"{uri!r} is not under a mounted volume (declared mounts: {declared}); the "
                        "worker's root filesystem is read-only and its own disk dies with the pod: add "
                        "spec.storage.claims (a ReadWriteMany PersistentVolumeClaim) or "
                        "spec.storage.volumes and volumeMounts"
                    ),
                )
            )
        elif written and found[1]:
            problems.append((field, f"{uri!r} is written but {found[0]} is mounted read-only"))
    return problems


def is_object_store_uri(uri: str) -> bool:
    """Whether the trainer reads or writes `uri` through the object store (s3://)."""
    return uri.startswith(OBJECT_STORE_SCHEME)


def object_store_uris(spec: FineTuneJobSpec) -> list[tuple[str, str]]:
    """(field, URI) of every field of the job that may name an object store."""
    uris = [(f"spec.{name}.uri", getattr(spec, name).uri or "") for name in _OBJECT_STORE_FIELDS]
    uris.append(("spec.dataset.uri", spec.dataset.uri))
    # A hub id has no scheme: a hub model naming one is a mistake this check reports.
    if spec.model.source in ("pvc", "uri") or "://" in spec.model.name:
        field = "spec.model.path" if spec.model.path else "spec.model.name"
        uris.append((field, spec.model.weights_location() or ""))
    return uris


def _read_problem(field: str, uri: str, spec: FineTuneJobSpec) -> str | None:
    """What the trainer cannot read of an s3:// URI it reads (dataset, weights)."""
    key = uri.removeprefix(OBJECT_STORE_SCHEME).partition("/")[2]
    if field == "spec.dataset.uri":
        if spec.dataset.format not in ("jsonl", "parquet"):
            return (
                f"{uri!r}: a dataset on object storage is read as jsonl or parquet objects; "
                f"format {spec.dataset.format} reads a hub id or a save_to_disk directory"
            )
        if not key or key.endswith("/"):
            return f"{uri!r} names no object: s3://<bucket>/<key> (a * glob in the last part)"
        if "*" in key.rpartition("/")[0]:
            return f"{uri!r}: a glob (*) is allowed only in the last part of the key"
    elif spec.model.source != "uri":
        return (
            f"{uri!r}: source {spec.model.source} does not read object storage; weights on "
            "object storage need spec.model.source uri"
        )
    return None


def object_store_problems(spec: FineTuneJobSpec) -> list[tuple[str, str]]:
    """(field, reason) for each object-store URI of the job the trainer cannot use: another
    scheme than s3://, no bucket, no storage.objectStore to say where and with which keys, or
    a read the trainer does not do (a dataset not in jsonl/parquet objects, weights of a
    source other than uri)."""
    problems: list[tuple[str, str]] = []
    for field, uri in object_store_uris(spec):
        scheme, sep, rest = uri.partition("://")
        if not sep or scheme in _NOT_OBJECT_STORES:
            continue
        if scheme == "gs":
            problems.append(
                (
                    field,
                    (
                        f"{uri!r}: gs:// is not supported; use s3:// through the GCS XML API "
                        "(storage.objectStore.endpointUrl https://storage.googleapis.com, an HMAC key "
                        "in the Secret)"
                    ),
                )
            )
        elif f"{scheme}://" != OBJECT_STORE_SCHEME:
            problems.append((field, f"{uri!r}: {scheme}:// is not supported; use s3:// or a path"))
        elif not rest.split("/", 1)[0]:
            problems.append((field, f"{uri!r} names no bucket: s3://<bucket>/<prefix>"))
        elif spec.storage.object_store is None:
            problems.append(
                (
                    field,
                    (
                        f"{uri!r} needs spec.storage.objectStore (secretName: a Secret with "
                        f"{' and '.join(SECRET_KEYS_REQUIRED)}; endpointUrl for S3-compatible stores)"
                    ),
                )
            )
        elif field not in ("spec.checkpoint.uri", "spec.output.uri"):
            problem = _read_problem(field, uri, spec)
            if problem:
                problems.append((field, problem))
    return problems
