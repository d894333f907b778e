"""Which job a storage directory belongs to (issue 11.6): nothing of another job, and nothing
that is not ours at all, is ever overwritten or deleted.

- A checkpoint root carries an ``OWNER`` file (JSON: uid, namespace, job) written on first
  use. The trainer purges and cleans only inside roots it owns; a root owned by another job is
  refused. A job re-created under the same namespace/name (a new uid: delete and re-apply to
  resume) takes the root over, since two live jobs can never share a namespace/name.
- An output directory is replaced only if it is absent, empty, or a previous export of the same
  job (its ``FINISHED`` marker names the same uid, or the same namespace/name).

Refusals raise `StorageRefusedError`, a configuration error: the trainer exits with it in its
termination report and the operator fails the job with the message instead of restarting it.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from typing import Any

from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.location import Location

OWNER_FILE = "OWNER"


class StorageRefusedError(UnsupportedConfigError):
    """A checkpoint or output directory that belongs to someone else."""


def identity(meta: Mapping[str, Any]) -> dict[str, str]:
    """The owner record of a job, from the trainer's meta (job name, namespace, uid)."""
    return {
        "uid": str(meta.get("uid") or ""),
        "namespace": str(meta.get("namespace") or ""),
        "job": str(meta.get("job") or ""),
    }


def _same_job(recorded: Mapping[str, Any], me: Mapping[str, str]) -> bool:
    if recorded.get("uid") and recorded.get("uid") == me["uid"]:
        return True
    # A job deleted and re-applied under the same name (new uid) resumes its own storage.
    theirs = (str(recorded.get("namespace") or ""), str(recorded.get("job") or ""))
    return bool(me["job"]) and theirs == (me["namespace"], me["job"])


def _describe(recorded: Mapping[str, Any]) -> str:
    ns, job, uid = recorded.get("namespace") or "?", recorded.get("job") or "?", recorded.get("uid")
    return f"job {ns}/{job} (uid {uid or 'unknown'})"


def read_owner(root: Location) -> dict[str, Any] | None:
    try:
        data = json.loads((root / OWNER_FILE).read_text())
    except FileNotFoundError:
        return None
    except PermissionError:
        raise  # credentials that may not read it: not a record of someone else
    except (OSError, ValueError):
        return {}  # unreadable: owned by someone we cannot name, so not by us
    return data if isinstance(data, dict) else {}


def _write_owner(root: Location, me: Mapping[str, str]) -> None:
    # Each writer its own temp file then a rename (locally), or one PUT (object store): racing
    # ranks (or racing jobs) leave one whole record, which every writer then reads back.
    text = json.dumps(dict(me), sort_keys=True) + "\n"
    tag = f".{socket.gethostname()}.{os.getpid()}"
    (root / OWNER_FILE).write_atomic(text.encode("utf-8"), tmp_tag=tag)


def claim_checkpoint_root(root: Location, meta: Mapping[str, Any]) -> None:
    """Make `root` this job's checkpoint directory, or refuse naming its owner.

    Called by every rank before anything is loaded, cleaned or purged there."""
    me = identity(meta)
    try:
        _claim(root, me)
    except (FileNotFoundError, PermissionError) as e:
        # A missing bucket, or credentials that may not write it: a configuration error, not
        # something a restart would fix.
        raise StorageRefusedError(f"checkpoint.uri {root} cannot be written: {e!r}") from e


def _claim(root: Location, me: Mapping[str, str]) -> None:
    root.makedirs()
    recorded = read_owner(root)
    if recorded is not None and _same_job(recorded, me) and recorded.get("uid") == me["uid"]:
        return
    if recorded is not None and not _same_job(recorded, me):
        raise StorageRefusedError(
            f"checkpoint.uri {root} belongs to {_describe(recorded)}; two jobs must not share "
            "a checkpoint directory (the other job's checkpoints would be loaded or purged): "
            "choose another checkpoint.uri"
        )
    _write_owner(root, me)
    after = read_owner(root) or {}
    if after.get("uid") != me["uid"]:
        raise StorageRefusedError(
            f"checkpoint.uri {root} was claimed at the same moment by {_describe(after)}; "
            "choose another checkpoint.uri"
        )


def check_output_target(root: Location, meta: Mapping[str, Any], marker: str) -> None:
    """Refuse to publish over anything but nothing, an empty directory or our own export."""
    link = root.is_local and root.local_path.is_symlink()
    if not root.exists() and not link:
        return
    if link or not root.is_dir():
        raise StorageRefusedError(
            f"output.uri {root} exists and is not a directory; refusing to replace it: "
            "choose a new or empty directory"
        )
    try:
        recorded = json.loads((root / marker).read_text())
    except FileNotFoundError:
        recorded = None
    except (OSError, ValueError):
        recorded = {}
    if recorded is None:
        if not root.children():
            return
        raise StorageRefusedError(
            f"output.uri {root} already holds files that are not an export of this job; "
            "refusing to replace them: choose a new or empty directory"
        )
    if not isinstance(recorded, dict) or not _same_job(recorded, identity(meta)):
        owner = _describe(recorded) if isinstance(recorded, dict) else "an unknown job"
        raise StorageRefusedError(
            f"output.uri {root} holds the export of {owner}; refusing to replace it: "
            "choose another output.uri"
        )
