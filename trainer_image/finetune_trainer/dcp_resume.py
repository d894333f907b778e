"""The load path of `dcp_checkpointer.DcpCheckpointer`: resume from the newest committed
checkpoint that loads on every rank.

The committed steps, newest first, as rank 0 lists them (every rank tries the same ones in
the same order, whatever its own view of a shared volume or a bucket). For each: rank 0 reads
its `COMMITTED` marker, DCP metadata and listing once and checks the structure, and every
rank gets all three (`_read_head`); every rank verifies its share of the manifest (sizes from
that listing, then hashes); DCP's load is given that same metadata (`agreed_reader`), never
reading it again. A step is used only if every rank passed every check and loaded it. Any
failure (DCP raises `CheckpointException`, which derives from BaseException, not Exception)
falls back to the previous step; rank 0 logs the step, the rank that failed it and why. One a check found damaged (missing, truncated, garbled, a manifest mismatch, an
unreadable marker) is moved aside by rank 0; one whose read failed without any check finding
damage (an I/O error) is left in place. A verified checkpoint whose keys or sizes do not
match this job's state (written for another model or setup: checkpoint_compat) is not
damage: every rank refuses the job before reading it, and nothing is moved. What
checkpoint_compat allows (optimizer state of parameters that never had a gradient,
param-group settings of another torch) is loaded, with a warning line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadPlanner

from finetune_trainer import checkpoint_store as store
from finetune_trainer.checkpoint_compat import (
    IncompatibleCheckpointError,
    Shape,
    compare,
    metadata_shapes,
    refusal_message,
    tolerate,
)
from finetune_trainer.checkpoint_fence import EPOCH_KEY, claim_epoch, read_epoch, stale_branch
from finetune_trainer.location import Location
from finetune_trainer.state import TrainState

log = logging.getLogger(__name__)

# Everything a failed load can raise, but not the interpreter's own exits (KeyboardInterrupt,
# SystemExit): DCP wraps every rank's failure in CheckpointException, a BaseException.
LOAD_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)


def agree(ok: bool, group: dist.ProcessGroup) -> bool:
    """True only if every rank says ok: ranks never resume from different steps, nor
    diverge on what is committed (the load and the save paths both agree through it)."""
    flag = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item() == 1.0)


class Resume:
    """One resume attempt over the committed checkpoints under `root` (a collective: every
    rank of `group` runs it). `skipped`: the committed steps found unusable, newest first,
    appended to as they are (the caller's list: still true when a refusal ends the attempt)."""

    def __init__(
        self,
        root: Location,
        state: TrainState,
        group: dist.ProcessGroup,
        meta: dict[str, Any],
        skipped: list[int],
    ) -> None:
        self.root = root
        self.state = state
        self.group = group
        self.rank = dist.get_rank(group)
        self.meta = meta
        self.skipped = skipped
        # A read that failed after DCP had begun copying into the live state (the model's
        # and optimizer's own tensors): (step, why).
        self.overwritten: tuple[int, str] | None = None
        # Rank 0: the epoch this incarnation claimed (checkpoint_fence); None: not claimed.
        self.epoch: int | None = None
        # Rank 0: the epoch record as read before the claim (None: unread), for a claim made
        # later when this one failed (checkpoint_fence.claim_late).
        self.seen_epoch: int | None = None
        # Rank 0: uncommitted steps the start-up cleanup left for later (store.deferred_plan).
        self.deferred: list[Location] = []

    def newest_loadable(self) -> int:
        """Load the newest committed checkpoint that loads; skip damaged ones. Returns its
        step (0: nothing usable). A read that failed part-way leaves the state partly
        overwritten; the next checkpoint loaded overwrites all of it. If none does, the
        process cannot start fresh from that state (part checkpoint, part initial weights):
        it raises, to be restarted, and the next start tries that checkpoint again."""
        for step in self._candidates():
            if self._try_load(step):
                return step
            self.skipped.append(step)
        if self.overwritten is not None:
            step, why = self.overwritten
            raise PartlyLoadedError(
                f"checkpoint step {step} under {self.root} failed while being read into this "
                f"process's model and optimizer ({why}) and no older checkpoint loaded: their "
                "state is part checkpoint, part initial, so training cannot start fresh from "
                f"it; exiting to be restarted (step {step} is left in place and tried again)"
            )
        return 0

    def _candidates(self) -> list[int]:
        """Rank 0 cleans partial saves and lists committed steps, newest first; all ranks
        get the same list so they try the same checkpoints in the same order. A listing
        that fails is raised on every rank (none is left waiting for rank 0's list)."""
        box: list[Any] = [None]
        error: Exception | None = None
        if self.rank == 0:
            try:
                self._claim_epoch()
                self._remove_partial()
                box[0] = self._unfenced(store.committed_newest_first(self.root))
            except Exception as e:
                error = e
                box[0] = f"rank 0 could not list the checkpoints under {self.root}: {e!r}"
        dist.broadcast_object_list(box, src=0, group=self.group)
        if error is not None:
            raise error
        if isinstance(box[0], str):
            raise OSError(box[0])
        return list(box[0])

    def _unfenced(self, committed: list[store.CheckpointDir]) -> list[int]:
        """The committed steps, newest first, less those a fenced writer committed over a
        newer incarnation's history (checkpoint_fence.stale_branch): left in place, logged."""
        epochs: dict[int, int | None] = {}
        for c in committed:
            epoch = (store.read_marker(c.path) or {}).get(EPOCH_KEY)
            epochs[c.step] = epoch if isinstance(epoch, int) else None
        stale = set(stale_branch(epochs))
        for step in sorted(stale, reverse=True):
            log.warning(
                "not resuming from checkpoint step %d under %s: committed by epoch %s, a writer "
                "fenced out by a newer incarnation that committed an older step after it",
                step, self.root, epochs[step],
            )  # fmt: skip
        return [c.step for c in committed if c.step not in stale]

    def _claim_epoch(self) -> None:
        """Before the cleanup: every writer that started earlier is fenced from here. A root
        this process cannot write (a read-only snapshot) still resumes: the first save claims
        then (unless a newer incarnation has claimed since: checkpoint_fence.claim_late), or
        fails as any save there would."""
        try:
            self.seen_epoch = read_epoch(self.root)
            self.epoch = claim_epoch(self.root)
        except OSError as e:
            log.warning("could not claim an epoch under %s (the first save will): %s", self.root, e)

    def _remove_partial(self) -> None:
        """A partial save that cannot be deleted (a bucket policy without DeleteObject, a
        read-only snapshot) is never loaded anyway: it must not stop the resume."""
        failed: list[tuple[Location, OSError]] = []
        spared: list[Location] = []
        for path in store.remove_partial(self.root, failed, spared, self.deferred):
            log.warning("removed uncommitted checkpoint %s", path)
        for path in spared:
            log.warning(
                "kept checkpoint %s: listed uncommitted, but its marker opens (a lagging view "
                "of the volume)", path,
            )  # fmt: skip
        for path, e in failed:
            log.warning("could not remove uncommitted checkpoint %s (never loaded): %s", path, e)

    def _read_head(
        self, path: Location, step: int
    ) -> tuple[Verdict, dict[str, Any], Any, dict[str, int]]:
        """Collective: rank 0 reads the marker, DCP's metadata and the directory's listing
        once and checks the structure; every rank gets the verdict and all three. Read once,
        decided once: ranks that read them each (on NFS or a bucket, at slightly different
        times) could see different bytes or listings, and DCP's own load, reading the
        metadata again on every rank, retries a failed read rank-locally from
        `__<rank>.metadata` (a file these checkpoints never have) and, if one is there, loads
        that rank alone on it. (Every rank listing a large prefix was N requests, too.)"""
        head: list[Any] = [(OK, ""), {}, None, {}]
        if self.rank == 0:

            def read() -> None:
                head[1] = store.read_commit_marker(path)
                store.check_marker_step(path, head[1], step)
                head[2] = store.read_dcp_metadata(path)
                head[3] = path.sizes()
                store.validate(path, head[2], head[3])

            failure, why = _attempt(path, read)
            head[0] = (failure, f"rank 0: {why}" if failure else "")
            if failure != OK:
                head[1:] = [{}, None, {}]
        dist.broadcast_object_list(head, src=0, group=self.group)
        return head[0], head[1], head[2], head[3]

    def _verify_share(self, path: Location, marker: dict[str, Any], sizes: dict[str, int]) -> None:
        """This rank's share of the marker's manifest (sizes, then hashes)."""
        manifest = store.manifest_of(marker)
        if manifest is None:
            if self.rank == 0:
                log.warning(
                    "checkpoint %s has no manifest (older format): structure checked only", path
                )
            return
        world = dist.get_world_size(self.group)
        store.verify_files(path, manifest, store.share_of(manifest, self.rank, world), sizes)

    def _try_load(self, step: int) -> bool:
        path = store.step_dir(self.root, step)
        (failure, why), marker, metadata, sizes = self._read_head(path, step)
        # Agree on each check before the next collective (DCP's load runs its own): a rank
        # that skipped one would leave the others waiting in it.
        if failure == OK:
            failure, why = agree_failure(
                _attempt(path, lambda: self._verify_share(path, marker, sizes)), self.group
            )
        if failure == OK:
            saved = metadata_shapes(metadata.state_dict_metadata)
            # Undamaged, so a mismatch is another model's checkpoint: refused, never moved.
            self._refuse_if_incompatible(step, saved, marker)

            def read(
                sd: dict[str, Any], planner: LoadPlanner | None = None, path: Location = path
            ) -> None:
                dcp.load(sd, storage_reader=agreed_reader(path, metadata), planner=planner,
                         process_group=self.group)  # fmt: skip

            failure, why = agree_failure(
                _attempt(path, lambda: self.state.load(read, set(saved))), self.group
            )
            if failure != OK:
                self.overwritten = (step, why)
        if failure == OK:
            self.overwritten = None  # all of it overwritten by this one
            return True
        if self.rank == 0:
            # One line naming the step and why, whichever rank saw it (its own line too).
            if failure == DAMAGED:
                # Out of the way of the save that will reach this step again, kept for a look.
                try:
                    where = f"moved aside to {store.quarantine(path)}"
                except OSError as e:
                    where = f"could not be moved aside ({e})"
                log.warning("skipped damaged checkpoint step %d (%s): %s", step, where, why)
            else:
                # Nothing shows it damaged (every check it reached passed; the read failed):
                # a good checkpoint on a storage that failed once is not thrown away. Left
                # in place, it is tried first again at the next start; a save reaching its
                # step again rewrites it (uncommitted first).
                log.warning(
                    "skipped checkpoint step %d (%s, left in place: no check found it "
                    "damaged): %s", step, path, why,
                )  # fmt: skip
        return False

    def _refuse_if_incompatible(
        self, step: int, saved: dict[str, Shape], marker: dict[str, Any]
    ) -> None:
        """Collective: every rank refuses if any rank's state does not fit the checkpoint
        (checkpoint_compat), so none is left waiting in DCP's load."""
        saved, expected = self.state.comparable(
            saved, self.state.expected_shapes(set(saved)), marker
        )  # a DeepSpeed checkpoint's flattened tensors with their recorded full shapes
        differences = compare(saved, expected)
        mine = None
        if differences:
            mine = refusal_message(
                step,
                str(self.root),
                differences,
                saved_backend=marker.get("backend"),
                backend=self.meta.get("backend"),
            )
        verdicts: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(verdicts, mine, group=self.group)
        refusal = next((v for v in verdicts if v), None)
        if refusal is not None:
            raise IncompatibleCheckpointError(refusal)
        allowance = tolerate(saved, expected)  # what TrainState.load leaves out
        if allowance and self.rank == 0:
            log.warning("checkpoint step %d in %s: %s", step, self.root, allowance.describe())


class PartlyLoadedError(RuntimeError):
    """No checkpoint loaded, and a failed one left the state partly overwritten."""


# A failed attempt, as every rank agrees on it (the worst any rank saw): OK; UNREADABLE (an
# I/O error, DCP's load failing after every check passed: not shown to be damage); DAMAGED (a
# check failed: missing, truncated, garbled, a hash or a marker wrong).
Failure = int
OK: Failure = 0
UNREADABLE: Failure = 1
DAMAGED: Failure = 2
Verdict = tuple[Failure, str]  # and why ("" when OK)


def worst(verdicts: list[Verdict]) -> Verdict:
    """Pure: the worst failure of the ranks' verdicts (indexed by rank), with the reason of
    the first rank that saw it."""
    failure = max((f for f, _ in verdicts), default=OK)
    if failure == OK:
        return OK, ""
    rank = next(r for r, (f, _) in enumerate(verdicts) if f == failure)
    return failure, f"rank {rank}: {verdicts[rank][1]}"


def agree_failure(verdict: Verdict, group: dist.ProcessGroup) -> Verdict:
    """Collective: `worst` of every rank's verdict, the same on every rank."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, verdict, group=group)
    return worst(gathered)


def _attempt(path: Location, action: Callable[[], object]) -> Verdict:
    try:
        action()
    except store.CorruptCheckpointError as e:
        log.warning("checkpoint %s is damaged, skipping it: %s", path, e)
        return DAMAGED, str(e)
    except LOAD_ERRORS as e:
        log.warning("checkpoint %s cannot be loaded, skipping it: %s", path, _short(e))
        return UNREADABLE, _short(e)
    return OK, ""


def agreed_reader(path: Location, metadata: Any) -> Any:
    """DCP's storage reader for `path` that hands DCP's load the metadata every rank agreed
    on instead of reading it again. Its `read_metadata` takes no keyword arguments, which is
    what keeps DCP (2.13's `_load_state_dict`) from falling back to a rank-local
    `__<rank>.metadata` read and a load without collectives on that rank alone."""
    reader = path.dcp_reader()
    load_id = getattr(reader, "load_id", None)

    def read_metadata() -> Any:
        # What the reader's own read_metadata sets on what it unpickled.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = load_id
        return metadata

    reader.read_metadata = read_metadata
    return reader


def _short(e: BaseException) -> str:
    """DCP's CheckpointException message embeds every rank's traceback: keep the first line."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
