"""Checkpointing behind a small contract: `load`, `maybe_save`, `wait_for_staging`,
`finish`, `close`. `DcpCheckpointer` saves with `torch.distributed.checkpoint.async_save` on a
dedicated gloo group; `NoOpCheckpointer` stands in when checkpointing is disabled.

Save path (main thread): wait for the previous save to be committed (at most one in flight,
so the staging buffers are free), capture the state dict and stage it into host buffers the
checkpointer owns (`staging.HostStaging`: allocated once, device copies enqueued on a side
stream). The loop calls `wait_for_staging()` before the optimizer step, the first moment the
live tensors change. A commit thread finishes the host copies, waits for the device copies,
writes the staged state with `dcp.save` on the checkpoint group, agrees with every rank that it
succeeded (all-reduce) and then rank 0 writes the `COMMITTED` marker and purges old
checkpoints, off the hot path. A failed save is logged with its traceback, counted
(`finetune_trainer_checkpoint_failures_total`) and remembered in `last_failed_step`; training
goes on and the next save tries again.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from finetune_operator.api.spec import CheckpointSpec
from finetune_trainer import checkpoint_store as store
from finetune_trainer.metrics import TrainerMetrics
from finetune_trainer.staging import HostStaging, StagedState
from finetune_trainer.state import TrainState

log = logging.getLogger(__name__)


class AsyncMode(enum.Enum):
    SYNC = "sync"  # save and commit before training goes on
    ASYNC = "async"  # stage and write in the background


def save_due(step: int, *, interval_steps: int | None, time_due: bool, last_saved: int) -> bool:
    """The "should save now" policy: on the step interval or when the time interval says so
    (decided collectively by the loop), never twice for one step, never at step 0."""
    if step <= 0 or step == last_saved:
        return False
    return time_due or bool(interval_steps and step % interval_steps == 0)


# Opt-in: stage through a snapshot in GPU memory (staging.py); costs a copy of the state there.
DEVICE_SNAPSHOT_ENV = "FT_CHECKPOINT_DEVICE_SNAPSHOT"
# DCP raises CheckpointException, a BaseException, when any rank fails a save.
SAVE_ERRORS = (Exception, CheckpointException)


class Checkpointer(Protocol):
    last_committed_step: int
    last_failed_step: int  # newest save that failed (0: none)

    def load(self) -> int: ...
    def prepare(self) -> None: ...
    def time_due(self) -> bool: ...
    def maybe_save(self, step: int, *, force: bool = False, time_due: bool = False) -> None: ...
    def wait_for_staging(self) -> None: ...
    def finish(self, timeout: float | None = None) -> bool: ...
    def close(self) -> None: ...


class NoOpCheckpointer:
    """Checkpointing disabled: nothing is loaded or saved."""

    last_committed_step = 0
    last_failed_step = 0

    def load(self) -> int:
        return 0

    def prepare(self) -> None:
        return None

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
        device: torch.device | None = None,
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
        self.last_failed_step = 0
        self._last_saved = 0
        self._last_save_time = time.monotonic()
        self._pending: tuple[StagedState, Future[None]] | None = None
        self._inflight: Future[bool] | None = None
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        snapshot = os.environ.get(DEVICE_SNAPSHOT_ENV) == "1"
        self.staging = (
            HostStaging(device, device_snapshot=snapshot) if self.mode is AsyncMode.ASYNC else None
        )
        self._prepared = False

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

    def _try_load(self, step: int) -> bool:
        path = store.step_dir(self.root, step)
        ok = 1.0
        try:
            store.validate(path)
            saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
            sd = self.state.template(saved)
            dcp.load(sd, checkpoint_id=path, process_group=self.group)
            self.state.restore(sd)
        except Exception as e:
            log.warning("checkpoint %s cannot be loaded, skipping it: %s", path, e)
            ok = 0.0
        # Every rank must agree, or ranks would resume from different steps.
        flag = torch.tensor([ok])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item() == 1.0)

    def load(self) -> int:
        """Resume from the newest committed checkpoint that loads; skip corrupt ones. Returns
        the step to continue from (0: nothing usable, start fresh)."""
        for step in self._candidates():
            if self._try_load(step):
                self.last_committed_step = self._last_saved = step
                self.metrics.last_ckpt_step.set(step)
                log.info("resumed from checkpoint step %d (%s)", step, self.root)
                return step
        log.info("no usable checkpoint under %s: starting at step 0", self.root)
        return 0

    # ---- save -------------------------------------------------------------------------------

    def time_due(self) -> bool:
        minutes = self.spec.interval_minutes
        return bool(minutes) and time.monotonic() - self._last_save_time >= 60 * float(minutes)

    def maybe_save(self, step: int, *, force: bool = False, time_due: bool = False) -> None:
        self.prepare()  # once, after the first step of a fresh run
        due = save_due(
            step,
            interval_steps=self.spec.interval_steps,
            time_due=time_due,
            last_saved=self._last_saved,
        )
        if due or (force and step > self._last_saved):
            self._save(step)

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

    def _save(self, step: int) -> None:
        t0 = time.monotonic()
        self.finish()  # at most one save in flight: the staging buffers are free again
        self.metrics.checkpoint_save_started()
        path = store.step_dir(self.root, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        sd = self.state.capture()
        if self.staging is not None:
            staged = self.staging.launch(sd)
            ready: Future[None] = Future()
            self._pending = (staged, ready)
            self._inflight = self._committer.submit(self._write_staged, staged, ready, step, t0)
        else:
            ok = self._attempt(
                step, "save", lambda: dcp.save(sd, checkpoint_id=path, process_group=self.group)
            )
            self._conclude(self._agree(ok), step, t0)
        self._last_saved = step
        self._last_save_time = time.monotonic()
        self.metrics.checkpoint_save_returned(step, time.monotonic() - t0)

    def _attempt(self, step: int, what: str, action: Any) -> bool:
        try:
            action()
        except SAVE_ERRORS:
            log.exception("checkpoint step %d: %s failed", step, what)
            return False
        return True

    def _agree(self, ok: bool) -> bool:
        """True when every rank succeeded: ranks must never diverge on what is committed."""
        flag = torch.tensor([1.0 if ok else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item() == 1.0)

    def _write_staged(self, staged: StagedState, ready: Future[None], step: int, t0: float) -> bool:
        """Commit thread: finish staging, write, commit. Every rank runs the same collectives
        whatever fails, so a failure on one rank never leaves another waiting."""
        try:
            ok = self._attempt(step, "staging", staged.copy_host)
        finally:
            ready.set_result(None)  # the loop may go on; a failure is reported below
        ok = self._attempt(step, "staging", staged.wait_device) and ok
        if self._agree(ok):
            path = store.step_dir(self.root, step)
            ok = self._attempt(
                step,
                "write",
                lambda: dcp.save(staged.state_dict, checkpoint_id=path, process_group=self.group),
            )
            ok = self._agree(ok)
        else:
            ok = False
        return self._conclude(ok, step, t0)

    def _conclude(self, ok: bool, step: int, t0: float) -> bool:
        if ok and self.rank == 0:
            ok = self._attempt(step, "commit", lambda: self._mark_committed(step))
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

    def _mark_committed(self, step: int) -> None:
        path = store.step_dir(self.root, step)
        store.write_marker(
            path, {**self.meta, "step": step, "worldSize": self.world_size, "time": time.time()}
        )
        for old in store.purge(self.root, self.spec.keep, below_step=step):
            log.info("purged checkpoint %s", old)

    def wait_for_staging(self) -> None:
        """Before the optimizer step: the host copies are done and the GPU will run the
        optimizer after the device copies (the host does not wait for those)."""
        if self._pending is None:
            return
        t = time.monotonic()
        staged, ready = self._pending
        self._pending = None
        ready.result()
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
            self._pending[0].release()  # staging is over: nothing may run before the copies
            self._pending = None
        self.metrics.checkpoint_window_closed()
        return True

    def close(self) -> None:
        self._committer.shutdown(wait=True)
        if self.staging is not None:
            self.staging.close()


def build_checkpointer(
    spec: CheckpointSpec | None,
    state: TrainState,
    *,
    group: dist.ProcessGroup,
    world_size: int,
    metrics: TrainerMetrics,
    meta: dict[str, Any],
    device: torch.device | None = None,
) -> Checkpointer:
    if spec is None or (spec.interval_steps is None and spec.interval_minutes is None):
        return NoOpCheckpointer()
    return DcpCheckpointer(
        spec,
        state,
        group=group,
        world_size=world_size,
        metrics=metrics,
        meta=meta,
        device=device,
    )
