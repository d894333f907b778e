"""Checkpointing behind a small contract: `load`, `maybe_save`, `wait_for_staging`,
`finish`, `close` (`Checkpointer`), an explicit async mode, the "save due" policy, and the
no-op stand-in when checkpointing is disabled. The implementation that saves and loads
committed DCP checkpoints is `dcp_checkpointer.DcpCheckpointer`; `build_checkpointer` picks one.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from finetune_operator.api.spec import CheckpointSpec
    from finetune_operator.api.storage import ObjectStoreSpec
    from finetune_trainer.metrics import TrainerMetrics
    from finetune_trainer.state import TrainState


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
    last_failed_step: int  # newest save that failed (0: none)
    resumed_from_step: int
    skipped: list[int]

    def load(self) -> int: ...
    def prepare(self) -> None: ...
    def time_due(self) -> bool: ...
    def maybe_save(self, step: int, *, force: bool = False, time_due: bool = False) -> bool: ...
    def wait_for_staging(self) -> None: ...
    def finish(self, timeout: float | None = None) -> bool: ...
    def close(self) -> None: ...  # frees what saves hold; again: a no-op


class NoOpCheckpointer:
    """Checkpointing disabled: nothing is loaded or saved."""

    last_committed_step = 0
    last_failed_step = 0

    resumed_from_step = 0

    def __init__(self) -> None:
        self.skipped: list[int] = []

    def load(self) -> int:
        return 0

    def prepare(self) -> None:
        return None

    def time_due(self) -> bool:
        return False

    def maybe_save(self, step: int, *, force: bool = False, time_due: bool = False) -> bool:
        return False

    def wait_for_staging(self) -> None:
        return None

    def finish(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        return None


def build_checkpointer(
    spec: CheckpointSpec | None,
    state: TrainState,
    *,
    group: dist.ProcessGroup,
    world_size: int,
    metrics: TrainerMetrics,
    meta: dict[str, Any],
    device: torch.device | None = None,
    object_store: ObjectStoreSpec | None = None,
) -> Checkpointer:
    if spec is None or not spec.enabled:
        return NoOpCheckpointer()
    if spec.interval_steps is None and spec.interval_minutes is None:
        return NoOpCheckpointer()
    # Here, not at the top: dcp_checkpointer imports this contract (AsyncMode, save_due).
    from finetune_trainer.dcp_checkpointer import DcpCheckpointer

    return DcpCheckpointer(
        spec,
        state,
        group=group,
        world_size=world_size,
        metrics=metrics,
        meta=meta,
        device=device,
        object_store=object_store,
    )
