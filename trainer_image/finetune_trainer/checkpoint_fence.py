"""Fencing a checkpoint root against the writers of an earlier incarnation, without a lock
service: on a shared POSIX volume and on `s3://` alike.

A pod of an earlier incarnation may still run on a cut-off node (a network partition: the
operator could not reach its kubelet and replaced it). Left alone it keeps saving into the same
root: its late `COMMITTED` could stand over the new incarnation's files of the same step, and
its purge (`keep`, counted on its own steps) could delete the new incarnation's checkpoints.

Every start of a worker group (the resume, on rank 0) claims the next epoch: one more than the
`EPOCH` record of the root, written whole (a rename locally, one PUT on a bucket). The claim
happens before the start-up cleanup, so every writer that started earlier holds a lower epoch.
Rank 0 re-reads the record before it writes a marker and again before it purges; a newer epoch
there means a newer incarnation owns the root: this writer is fenced (`FencedError`), commits
and purges nothing more, and saves nothing more. Its marker records its epoch (`epoch`), so a
marker written in the window between its last check and its write can be told apart.

The record is read by opening it (`cat_file`): on NFS an open revalidates (close-to-open
consistency) where a `stat` may be answered from the attribute cache; a bucket is strongly
consistent. Two incarnations claiming at the same moment is not a case the operator creates
(it starts one group at a time); if it happened, both would hold the same epoch and neither
would be fenced by the other, as before fencing.
"""

from __future__ import annotations

from finetune_trainer.location import Location

EPOCH_FILE = "EPOCH"
EPOCH_KEY = "epoch"  # in the COMMITTED marker: the epoch of the writer that committed it


class FencedError(Exception):
    """A newer incarnation has claimed the checkpoint root: this writer must stop."""


def read_epoch(root: Location) -> int:
    """The newest epoch claimed under `root` (0: none yet). An unreadable record reads as 0:
    the next claim rewrites it whole."""
    try:
        return max(0, int((root / EPOCH_FILE).read_text().strip()))
    except (FileNotFoundError, ValueError):  # absent; not a number (UnicodeDecodeError too)
        return 0


def claim_epoch(root: Location) -> int:
    """Claim the next epoch for this incarnation's writers (rank 0, at resume)."""
    epoch = read_epoch(root) + 1
    (root / EPOCH_FILE).write_atomic(f"{epoch}\n".encode())
    return epoch


def claim_late(root: Location, seen: int | None) -> int:
    """The epoch of a writer whose claim at its start failed (a transient error of the
    store), claimed when it first needs one (its first save). `seen`: the record it read at
    its start (None: unread). A record newer than that is the claim of an incarnation that
    started since: claiming over it would fence that one out and let this stale writer go
    on, so `seen` is returned instead, which `check_fence` refuses."""
    if seen is not None and fenced_by(seen, read_epoch(root)):
        return seen
    return claim_epoch(root)


def fenced_by(mine: int, newest: int) -> bool:
    """Pure: whether a writer of epoch `mine` is fenced out by the newest claimed epoch."""
    return newest > mine


def check_fence(root: Location, mine: int, what: str) -> None:
    """Raise FencedError if a newer incarnation has claimed `root` (`what`: the action that
    is refused, for the message)."""
    newest = read_epoch(root)
    if fenced_by(mine, newest):
        raise FencedError(
            f"{root} was claimed by a newer incarnation (epoch {newest}, this writer's is "
            f"{mine}): not doing {what}; this process saves and purges nothing more there"
        )


def stale_branch(epochs: dict[int, int | None]) -> list[int]:
    """Pure: the committed steps (step -> its marker's epoch; None for a marker from before
    epochs) that a fenced writer committed in the window between its last check and its
    marker: a step whose epoch is older than that of a committed step *below* it. The newer
    incarnation resumed from an older step and committed past it, so such a marker is of a
    history the job abandoned (its files may stand over the newer incarnation's): never
    resumed from. Steps are in any order; the result is oldest first."""
    newest_below = 0
    stale = []
    for step in sorted(epochs):
        epoch = epochs[step]
        if epoch is None:
            continue
        if epoch < newest_below:
            stale.append(step)
        else:
            newest_below = epoch
    return stale
