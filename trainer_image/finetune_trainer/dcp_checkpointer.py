"""`DcpCheckpointer`: the `checkpointer.Checkpointer` that saves with
`torch.distributed.checkpoint.async_save` on a dedicated gloo group and resumes from the newest
committed checkpoint that loads.

Save path (main thread): wait for the previous save to be committed (at most one in flight,
so the staging buffers are free), capture the state dict and stage it into host buffers the
checkpointer owns (`staging.HostStaging`: allocated once, device copies enqueued on a side
stream). The loop calls `wait_for_staging()` before the optimizer step, the first moment the
live tensors change. A commit thread finishes the host copies, waits for the device copies,
writes the staged state with `dcp.save` on the checkpoint group, agrees with every rank that it
succeeded (all-reduce) and then rank 0 writes the `COMMITTED` marker and purges old
checkpoints, off the hot path. A failed save is logged with its traceback, counted
(`finetune_trainer_checkpoint_failures_total`) and remembered in `last_failed_step`; training
goes on and the next save tries again. Before the marker, each rank hashes the files it wrote
and rank 0 writes the gathered manifest (size + hash per file) into `COMMITTED`.

The root is a directory on a volume or an s3:// prefix (`location.Location`, which also hands
out DCP's storage writer and reader: fsspec's for a bucket, DCP's os-based ones for a volume);
everything else goes through the same interface, so every property here holds on both.

Load path (`dcp_resume.Resume`): the newest committed checkpoint that every rank verifies and
loads, on the marker, metadata and listing rank 0 read; a damaged one is skipped and moved
aside, one that failed to read without being found damaged skipped and left in place, another
model's refused (`checkpoint_compat`). `resumed_from_step` and `skipped` say what happened.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from finetune_operator.api.spec import CheckpointSpec
from finetune_operator.api.storage import ObjectStoreSpec
from finetune_trainer import checkpoint_store as store
from finetune_trainer.checkpoint_fence import EPOCH_KEY, FencedError, check_fence, claim_late
from finetune_trainer.checkpoint_hygiene import (
    cleanup_grace,
    default_grace,
    purge_deferred,
    read_mounts,
)
from finetune_trainer.checkpointer import AsyncMode, save_due
from finetune_trainer.dcp_resume import Resume, agree
from finetune_trainer.location import Location
from finetune_trainer.metrics import TrainerMetrics
from finetune_trainer.ownership import claim_checkpoint_root
from finetune_trainer.staging import HostStaging, StagedState
from finetune_trainer.state import TrainState

log = logging.getLogger(__name__)

# Stage through a snapshot in GPU memory (staging.py; spec.checkpoint.deviceSnapshot, which the
# planner counts): "1" or "0" here overrides the spec (an experiment on a running image).
DEVICE_SNAPSHOT_ENV = "FT_CHECKPOINT_DEVICE_SNAPSHOT"
# DCP raises CheckpointException, a BaseException, when any rank fails a save.
SAVE_ERRORS = (Exception, CheckpointException)


def device_snapshot(spec: CheckpointSpec, env: Mapping[str, str]) -> bool:
    """Whether saves stage through a GPU snapshot: the spec's field, unless the env var says
    "1" or "0" (anything else is refused: a typo must not silently mean the spec's value)."""
    value = env.get(DEVICE_SNAPSHOT_ENV)
    if value is None or value == "":
        return spec.device_snapshot
    if value not in ("0", "1"):
        raise ValueError(f"{DEVICE_SNAPSHOT_ENV} must be 0 or 1, not {value!r}")
    return value == "1"


class DcpCheckpointer:
    """Committed DCP checkpoints under `spec.uri` (see the module docstring)."""

    def __init__(
        self,
        spec: CheckpointSpec,
        state: TrainState,
        *,
        group: dist.ProcessGroup,
        world_size: int,
        metrics: TrainerMetrics,
        meta: dict[str, Any],
        device: torch.device | None = None,
        cwd: Path | None = None,
        object_store: ObjectStoreSpec | None = None,
    ) -> None:
        self.root = store.resolve_root(spec.uri, cwd, object_store)
        # Before anything is loaded, cleaned or purged there: the root must be this job's.
        claim_checkpoint_root(self.root, meta)
        self.spec = spec
        self.state = state
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = world_size
        self.metrics = metrics
        self.meta = meta
        self.mode = AsyncMode.ASYNC if spec.async_ else AsyncMode.SYNC
        self.last_committed_step = 0
        self.last_failed_step = 0
        self.resumed_from_step = 0  # the step load() really resumed from (0: fresh start)
        self.skipped: list[int] = []  # committed steps load() found unusable, newest first
        # Rank 0: this incarnation's epoch (checkpoint_fence), claimed by load() or, with no
        # load, by the first save; `fenced` (every rank) once a newer incarnation has claimed
        # the root: no more saves.
        self.epoch: int | None = None
        self._seen_epoch: int | None = None  # rank 0: the record load() read (claim_late)
        self.fenced = False
        # Rank 0: what the start-up cleanup left for later, and when it looked.
        self._deferred: list[Location] = []
        self._deferred_since = 0.0
        self._grace = cleanup_grace(os.environ, default_grace(self.root, read_mounts()))
        self._last_saved = 0
        self._last_save_time = time.monotonic()
        self._pending: tuple[StagedState | None, Future[None]] | None = None
        self._inflight: Future[bool] | None = None
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        snapshot = device_snapshot(spec, os.environ)
        self.staging = (
            HostStaging(device, device_snapshot=snapshot) if self.mode is AsyncMode.ASYNC else None
        )
        self._prepared = False

    # ---- load (dcp_resume) --------------------------------------------------------------

    def load(self) -> int:
        """Resume from the newest committed checkpoint that loads; skip damaged ones
        (dcp_resume). Returns the step to continue from (0: nothing usable, start fresh)."""
        resume = Resume(self.root, self.state, self.group, self.meta, self.skipped)
        step = resume.newest_loadable()
        if self.rank == 0:
            self.epoch, self._seen_epoch = resume.epoch, resume.seen_epoch
            self._deferred, self._deferred_since = resume.deferred, time.monotonic()
        if step:
            self.last_committed_step = self._last_saved = self.resumed_from_step = step
            self.metrics.last_ckpt_step.set(step)
            self.metrics.observe_resume(step, self.skipped)
            log.info("resumed from checkpoint step %d (%s)", step, self.root)
            return step
        self.metrics.observe_resume(0, self.skipped)
        log.info("no usable checkpoint under %s: starting at step 0", self.root)
        return 0

    # ---- save -------------------------------------------------------------------------------

    def time_due(self) -> bool:
        minutes = self.spec.interval_minutes
        return bool(minutes) and time.monotonic() - self._last_save_time >= 60 * float(minutes)

    def maybe_save(self, step: int, *, force: bool = False, time_due: bool = False) -> bool:
        """Save if due; True if a save started at this step (the step trace marks it)."""
        self.prepare()  # once, after the first step of a fresh run
        if self.fenced:
            return False  # a newer incarnation owns the root: nothing more is written there
        due = save_due(
            step,
            interval_steps=self.spec.interval_steps,
            time_due=time_due,
            last_saved=self._last_saved,
        )
        if due or (force and step > self._last_saved):
            return self._save(step)
        return False

    def prepare(self) -> None:
        """Allocate the staging buffers ahead of the first save, so that save does not pay
        for pinning gigabytes of host memory (~3 GB/s) in the middle of training. Needs the
        optimizer state: before the first step (a fresh run) capturing the state would
        initialise it with a zero-gradient step (Adam's step count off by one), so then it is
        done by `maybe_save` after the first step. Idempotent."""
        if self.staging is None or self._prepared or not self.state.optimizer.state:
            return
        t = time.monotonic()
        self.staging.reserve(self.state.capture())
        self._prepared = True
        log.info("checkpoint staging buffers ready in %.2fs", time.monotonic() - t)

    def _save(self, step: int) -> bool:
        t0 = time.monotonic()
        self.finish()  # at most one save in flight: the staging buffers are free again
        # Fenced before anything is written (a stale writer's first act below would be to
        # remove a newer incarnation's marker of this step), agreed so every rank stops.
        if not agree(self._fence_ok(step), self.group):
            self.fenced = True
            # Counted as a failed save: CheckpointFailing says this process saves no more.
            self.last_failed_step = max(self.last_failed_step, step)
            self.metrics.observe_checkpoint_failed(step)
            log.error("checkpoint step %d not saved: a newer incarnation owns %s", step, self.root)
            return False
        self.metrics.checkpoint_save_started()
        path = store.step_dir(self.root, step)
        # Saving a step again (after resuming from an older one): never look committed mid-write.
        if self.rank == 0:
            # A path that is not a directory fails the save below, counted like any failure.
            with contextlib.suppress(OSError):
                (path / store.CHECKPOINT_COMMITTED_MARKER).remove()
        if self.staging is not None:
            staging = self.staging
            launched: list[StagedState] = []
            # A failure here (no memory to pin, a missing volume) must not stop training, and
            # this rank must still join the commit thread's agreement or its peers would wait.
            self._attempt(step, "staging", lambda: launched.append(self._launch(staging, path)))
            staged = launched[0] if launched else None
            ready: Future[None] = Future()
            self._pending = (staged, ready)
            self._inflight = self._committer.submit(self._write_staged, staged, ready, step, t0)
        else:

            def save() -> None:
                self.root.makedirs()
                dcp.save(
                    self.state.capture(), storage_writer=path.dcp_writer(), process_group=self.group
                )

            self._conclude(agree(self._attempt(step, "save", save), self.group), step, t0)
        self._last_saved = step
        self._last_save_time = time.monotonic()
        self.metrics.checkpoint_save_returned(step, time.monotonic() - t0)
        return True

    def _launch(self, staging: HostStaging, path: Location) -> StagedState:
        self.root.makedirs()
        return staging.launch(self.state.capture())

    def _attempt(self, step: int, what: str, action: Any) -> bool:
        try:
            action()
        except SAVE_ERRORS:
            log.exception("checkpoint step %d: %s failed", step, what)
            return False
        return True

    def _write_staged(
        self, staged: StagedState | None, ready: Future[None], step: int, t0: float
    ) -> bool:
        """Commit thread: finish staging, write, commit. Every rank runs the same collectives
        whatever fails, so a failure on one rank never leaves another waiting."""
        try:
            ok = staged is not None and self._attempt(step, "staging", staged.copy_host)
        finally:
            ready.set_result(None)  # the loop may go on; a failure is reported below
        ok = ok and staged is not None and self._attempt(step, "staging", staged.wait_device)
        if agree(ok, self.group) and staged is not None:
            path = store.step_dir(self.root, step)
            ok = self._attempt(
                step,
                "write",
                lambda: dcp.save(
                    staged.state_dict, storage_writer=path.dcp_writer(), process_group=self.group
                ),
            )
            ok = agree(ok, self.group)
        else:
            ok = False
        return self._conclude(ok, step, t0)

    def _conclude(self, ok: bool, step: int, t0: float) -> bool:
        """Every rank: hash what it wrote, gather the manifest; rank 0 commits it."""
        path = store.step_dir(self.root, step)
        described: list[dict[str, dict[str, Any]]] = []
        if ok:
            # Each rank hashes its own files (in parallel, from the page cache just filled).
            ok = self._attempt(step, "hash", lambda: described.append(
                store.describe_files(path, store.files_written_by(path, self.rank))
            ))  # fmt: skip
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, described[0] if described else None, group=self.group)
        ok = ok and all(part is not None for part in gathered)
        if ok:
            committed = True
            if self.rank == 0:
                manifest = {name: entry for part in gathered for name, entry in part.items()}
                committed = self._attempt(
                    step, "commit", lambda: self._mark_committed(step, manifest)
                )
            # Rank 0's verdict for every rank: the others reported the step committed (and
            # the final report's step) when rank 0 had failed to write its marker.
            ok = agree(committed, self.group)
        if not ok:
            self.last_failed_step = max(self.last_failed_step, step)
            self.metrics.observe_checkpoint_failed(step)
            log.error(
                "checkpoint step %d NOT committed; newest committed checkpoint: step %d",
                step,
                self.last_committed_step,
            )
            return False
        self.last_committed_step = step
        self.metrics.observe_checkpoint_committed(step, time.monotonic() - t0)
        log.info("checkpoint step %d committed in %.2fs", step, time.monotonic() - t0)
        return True

    def _fence_ok(self, step: int) -> bool:
        """False on rank 0 if fenced. A record that cannot be read (a transient error) fences
        nothing: the save goes on (and fails, counted, if the volume is really gone)."""
        if self.rank != 0:
            return True
        try:
            self._fence(f"the save of step {step}")
        except FencedError as e:
            log.error("%s", e)
            return False
        except OSError as e:
            log.warning("checkpoint step %d: the epoch record could not be read (%s)", step, e)
        return True

    def _fence(self, what: str) -> None:
        """Rank 0: raise FencedError if a newer incarnation claimed the root (the next save's
        agreed check then stops every rank: `fenced` is set only there, on all of them)."""
        if self.epoch is None:
            self.epoch = claim_late(self.root, self._seen_epoch)
        check_fence(self.root, self.epoch, what)

    def _mark_committed(self, step: int, manifest: dict[str, dict[str, Any]]) -> None:
        path = store.step_dir(self.root, step)
        # A fenced writer's marker could stand over the new incarnation's files of this step.
        self._fence(f"the commit of step {step}")
        meta = {
            **self.meta,
            **self.state.marker_record(),  # what the state's own compatibility check reads
            "step": step,
            "worldSize": self.world_size,
            "time": time.time(),
        }
        meta[store.HASH_KEY] = store.HASH_ALGORITHM
        meta[store.MANIFEST_KEY] = manifest
        meta[EPOCH_KEY] = self.epoch
        store.write_marker(path, meta)
        try:
            # Again before deleting anything: a purge counted on this writer's steps would
            # delete a newer incarnation's checkpoints.
            what = f"the purge after step {step}"
            self._fence(what)

            def guard() -> None:
                # Before each delete: the window is one delete, not a purge.
                self._fence(what)

            for old in store.purge(self.root, self.spec.keep, below_step=step, guard=guard):
                log.info("purged checkpoint %s", old)
            self._purge_deferred(guard)
        except FencedError as e:
            log.error("checkpoint step %d committed by a fenced writer: %s", step, e)
        except OSError as e:
            # The step is committed (its marker is written): a delete that failed leaves an
            # old checkpoint for the next purge, it does not fail this save.
            log.warning("checkpoint step %d committed; purging older ones failed: %s", step, e)

    def _purge_deferred(self, guard: Callable[[], None]) -> None:
        """Delete the uncommitted steps the start-up cleanup left, once the grace is over and
        if their marker still does not open (no save of this writer is in flight: this runs
        in the commit; `guard`: nor is this writer fenced)."""
        if not self._deferred or time.monotonic() - self._deferred_since < self._grace:
            return
        for path in purge_deferred(self._deferred, guard):
            log.info("purged uncommitted checkpoint %s (left at start)", path)
        self._deferred = []

    def wait_for_staging(self) -> None:
        """Before the optimizer step: the host copies are done and the GPU will run the
        optimizer after the device copies (the host does not wait for those)."""
        if self._pending is None:
            return
        t = time.monotonic()
        staged, ready = self._pending
        self._pending = None
        ready.result()
        if staged is not None:
            staged.release()
        self.metrics.checkpoint_staging_waited(time.monotonic() - t)

    def finish(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight save to be committed (or fail). False on timeout."""
        if self._inflight is not None:
            try:
                self._inflight.result(timeout=timeout)
            except FutureTimeout:
                return False
            self._inflight = None
        if self._pending is not None:
            staged, self._pending = self._pending[0], None
            if staged is not None:
                staged.release()  # staging is over: nothing may run before the copies
        self.metrics.checkpoint_window_closed()
        return True

    def close(self) -> None:
        self._committer.shutdown(wait=True)
        if self.staging is not None:
            self.staging.close()
