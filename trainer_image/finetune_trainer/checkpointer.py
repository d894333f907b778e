"""Checkpointing behind a small contract: `load`, `maybe_save`, `wait_for_staging`,
`finish`, `close`. `DcpCheckpointer` saves with `torch.distributed.checkpoint.async_save` on a
dedicated gloo group; `NoOpCheckpointer` stands in when checkpointing is disabled.

Save path (main thread): wait for the previous save to be committed (at most one in flight),
capture the state dict, hand it to DCP, which stages it (copies it off the live tensors) in a
background thread and then writes it from another one. The loop calls `wait_for_staging()`
before the optimizer step, the first moment the live tensors change. A commit thread waits
for the write, has each rank hash the files it wrote, gathers the hashes and the verdicts
on the checkpoint group, and then rank 0 writes the `COMMITTED` marker (with the manifest)
and purges old checkpoints, off the hot path.

Load path: the committed steps, newest first; a step is used only if every rank verified its
share of the manifest and loaded it. Any failure (DCP raises `CheckpointException`, which
derives from BaseException, not Exception) falls back to the previous step; rank 0 moves the
damaged one aside. `resumed_from_step` and `skipped` say what happened.
"""

from __future__ import annotations

import enum
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from finetune_operator.api.spec import CheckpointSpec
from finetune_trainer import checkpoint_store as store
from finetune_trainer.metrics import TrainerMetrics
from finetune_trainer.state import TrainState

log = logging.getLogger(__name__)

# Everything a failed load can raise, but not the interpreter's own exits (KeyboardInterrupt,
# SystemExit): DCP wraps every rank's failure in CheckpointException, a BaseException.
LOAD_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)


class AsyncMode(enum.Enum):
    SYNC = "sync"  # save and commit before training goes on
    ASYNC = "async"  # stage and write in the background


def save_due(step: int, *, interval_steps: int | None, time_due: bool, last_saved: int) -> bool:
    """The "should save now" policy: on the step interval or when the time interval says so
    (decided collectively by the loop), never twice for one step, never at step 0."""
    if step <= 0 or step == last_saved:
        return False
    return time_due or bool(interval_steps and step % interval_steps == 0)


class Checkpointer(Protocol):
    last_committed_step: int
    resumed_from_step: int
    skipped: list[int]

    def load(self) -> int: ...
    def time_due(self) -> bool: ...
    def maybe_save(self, step: int, *, force: bool = False, time_due: bool = False) -> None: ...
    def wait_for_staging(self) -> None: ...
    def finish(self, timeout: float | None = None) -> bool: ...
    def close(self) -> None: ...


class NoOpCheckpointer:
    """Checkpointing disabled: nothing is loaded or saved."""

    last_committed_step = 0
    resumed_from_step = 0

    def __init__(self) -> None:
        self.skipped: list[int] = []

    def load(self) -> int:
        return 0

    def time_due(self) -> bool:
        return False

    def maybe_save(self, step: int, *, force: bool = False, time_due: bool = False) -> None:
        return None

    def wait_for_staging(self) -> None:
        return None

    def finish(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        return None


class DcpCheckpointer:
    def __init__(
        self,
        spec: CheckpointSpec,
        state: TrainState,
        *,
        group: dist.ProcessGroup,
        world_size: int,
        metrics: TrainerMetrics,
        meta: dict[str, Any],
        cwd: Path | None = None,
    ) -> None:
        self.root = store.resolve_root(spec.uri, cwd)
        self.spec = spec
        self.state = state
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = world_size
        self.metrics = metrics
        self.meta = meta
        self.mode = AsyncMode.ASYNC if spec.async_ else AsyncMode.SYNC
        self.last_committed_step = 0
        self.resumed_from_step = 0  # the step load() really resumed from (0: fresh start)
        self.skipped: list[int] = []  # committed steps load() found unusable, newest first
        self._last_saved = 0
        self._last_save_time = time.monotonic()
        self._staging: Future[Any] | None = None
        self._inflight: Future[bool] | None = None
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")
        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
        )

    # ---- load -------------------------------------------------------------------------------

    def _candidates(self) -> list[int]:
        """Rank 0 cleans partial saves and lists committed steps, newest first; all ranks
        get the same list so they try the same checkpoints in the same order."""
        steps: list[int] = []
        if self.rank == 0:
            for path in store.remove_partial(self.root):
                log.warning("removed uncommitted checkpoint %s", path)
            steps = [c.step for c in store.committed_newest_first(self.root)]
        box: list[Any] = [steps]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return list(box[0])

    def _verify(self, path: Path) -> None:
        """Structure, then this rank's share of the manifest (sizes, then hashes)."""
        store.validate(path)
        manifest = store.manifest_of(store.read_marker(path))
        if manifest is None:
            log.warning("checkpoint %s has no manifest (older format): structure checked only", path)
            return
        world = dist.get_world_size(self.group)
        store.verify_files(path, manifest, store.share_of(manifest, self.rank, world))

    def _agree(self, ok: bool) -> bool:
        """True only if every rank says ok (so ranks never resume from different steps)."""
        flag = torch.tensor([1.0 if ok else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item() == 1.0)

    def _try_load(self, step: int) -> bool:
        path = store.step_dir(self.root, step)
        ok = True
        try:
            self._verify(path)
        except LOAD_ERRORS as e:
            log.warning("checkpoint %s cannot be loaded, skipping it: %s", path, _short(e))
            ok = False
        # Agree on the verification before DCP's load, which runs collectives of its own: a
        # rank that skipped it would leave the others waiting in them.
        if self._agree(ok):
            try:
                saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
                sd = self.state.template(saved)
                dcp.load(sd, checkpoint_id=path, process_group=self.group)
                self.state.restore(sd)
            except LOAD_ERRORS as e:
                log.warning("checkpoint %s cannot be loaded, skipping it: %s", path, _short(e))
                ok = False
            ok = self._agree(ok)
        else:
            ok = False
        if not ok and self.rank == 0:
            # Out of the way of the save that will reach this step again, kept for a look.
            try:
                log.warning("moved damaged checkpoint to %s", store.quarantine(path))
            except OSError as e:
                log.warning("could not move damaged checkpoint %s aside: %s", path, e)
        return ok

    def load(self) -> int:
        """Resume from the newest committed checkpoint that loads; skip corrupt ones. Returns
        the step to continue from (0: nothing usable, start fresh). A checkpoint that failed
        on one rank leaves the others' state half-restored; the next one loaded overwrites
        all of it, and a fresh start (0) is only reached by a rank that loaded nothing."""
        for step in self._candidates():
            if self._try_load(step):
                self.last_committed_step = self._last_saved = self.resumed_from_step = step
                self.metrics.last_ckpt_step.set(step)
                self.metrics.observe_resume(step, self.skipped)
                log.info("resumed from checkpoint step %d (%s)", step, self.root)
                return step
            self.skipped.append(step)
        self.metrics.observe_resume(0, self.skipped)
        log.info("no usable checkpoint under %s: starting at step 0", self.root)
        return 0

    # ---- save -------------------------------------------------------------------------------

    def time_due(self) -> bool:
        minutes = self.spec.interval_minutes
        return bool(minutes) and time.monotonic() - self._last_save_time >= 60 * float(minutes)

    def maybe_save(self, step: int, *, force: bool = False, time_due: bool = False) -> None:
        due = save_due(
            step,
            interval_steps=self.spec.interval_steps,
            time_due=time_due,
            last_saved=self._last_saved,
        )
        if due or (force and step > self._last_saved):
            self._save(step)

    def _save(self, step: int) -> None:
        t0 = time.monotonic()
        self.finish()  # at most one save in flight
        path = store.step_dir(self.root, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Saving a step again (after resuming from an older one): never look committed mid-write.
        if self.rank == 0:
            (path / store.CHECKPOINT_COMMITTED_MARKER).unlink(missing_ok=True)
        sd = self.state.capture()
        if self.mode is AsyncMode.ASYNC:
            resp = dcp.async_save(
                sd, checkpoint_id=path, process_group=self.group, async_stager=self._stager
            )
            staging, upload = (
                (resp.staging_completion, resp.upload_completion)
                if hasattr(resp, "upload_completion")
                else (None, resp)
            )
            self._staging = staging
            self._inflight = self._committer.submit(self._commit, upload, step, t0)
        else:
            done: Future[Any] = Future()
            try:
                dcp.save(sd, checkpoint_id=path, process_group=self.group)
                done.set_result(None)
            except LOAD_ERRORS as e:
                done.set_exception(e)
            self._commit(done, step, t0)
        self._last_saved = step
        self._last_save_time = time.monotonic()
        self.metrics.observe_checkpoint_blocking(time.monotonic() - t0)

    def _commit(self, upload: Future[Any], step: int, t0: float) -> bool:
        path = store.step_dir(self.root, step)
        files: dict[str, dict[str, Any]] | None = None
        try:
            upload.result()
            # Each rank hashes what it wrote (in parallel, from the page cache just filled).
            files = store.describe_files(path, store.files_written_by(path, self.rank))
        except LOAD_ERRORS as e:
            log.error("checkpoint step %d failed: %s", step, _short(e))
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, files, group=self.group)
        if any(part is None for part in gathered):
            return False
        if self.rank == 0:
            manifest = {name: entry for part in gathered for name, entry in part.items()}
            meta = {**self.meta, "step": step, "worldSize": self.world_size, "time": time.time()}
            meta[store.HASH_KEY] = store.HASH_ALGORITHM
            meta[store.MANIFEST_KEY] = manifest
            store.write_marker(path, meta)
            for old in store.purge(self.root, self.spec.keep, below_step=step):
                log.info("purged checkpoint %s", old)
        self.last_committed_step = step
        self.metrics.observe_checkpoint_committed(step, time.monotonic() - t0)
        log.info("checkpoint step %d committed in %.2fs", step, time.monotonic() - t0)
        return True

    def wait_for_staging(self) -> None:
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def finish(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight save to be committed (or fail). False on timeout."""
        if self._inflight is None:
            return True
        try:
            self._inflight.result(timeout=timeout)
        except FutureTimeout:
            return False
        self._inflight = None
        self._staging = None
        return True

    def close(self) -> None:
        self._committer.shutdown(wait=True)
        self._stager.close()


def _short(e: BaseException) -> str:
    """DCP's CheckpointException message embeds every rank's traceback: keep the first line."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def build_checkpointer(
    spec: CheckpointSpec | None,
    state: TrainState,
    *,
    group: dist.ProcessGroup,
    world_size: int,
    metrics: TrainerMetrics,
    meta: dict[str, Any],
) -> Checkpointer:
    if spec is None or (spec.interval_steps is None and spec.interval_minutes is None):
        return NoOpCheckpointer()
    return DcpCheckpointer(
        spec, state, group=group, world_size=world_size, metrics=metrics, meta=meta
    )
