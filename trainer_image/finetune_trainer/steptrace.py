"""The per-rank step trace that `ftjob stragglers` replays: one JSON line per step with this
rank's compute and wait seconds, its pod, node and torchelastic restart count, and whether the
step saved a checkpoint (format: `finetune_operator.stragglers.trace`).

Enabled by `FINETUNE_STEP_TRACE_DIR`; each rank appends to `<dir>/rank-<rank>.jsonl`, so a
re-formed group (other pods on the same ranks) keeps appending to the same files and the
detector tells the runs apart by pod and restart count. Disabled, it is a no-op object.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Protocol

from finetune_trainer.config import RuntimeEnv
from finetune_trainer.metrics import StepStats


class StepTrace(Protocol):
    def record(self, stats: StepStats, *, checkpoint: bool) -> None: ...
    def close(self) -> None: ...


class NoOpStepTrace:
    def record(self, stats: StepStats, *, checkpoint: bool) -> None:
        return None

    def close(self) -> None:
        return None


class JsonlStepTrace:
    def __init__(
        self,
        directory: Path,
        *,
        rank: int,
        pod: str | None,
        node: str | None,
        restart: int,
        started: float | None = None,
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"rank-{rank}.jsonl"
        # Line-buffered: each step's line reaches the file when written, so a pod killed
        # mid-run leaves every completed step behind.
        self._fh = self.path.open("a", buffering=1, encoding="utf-8")
        # `started` tells this process's run apart from an earlier one of the same rank, pod
        # and restart count (a re-form that only added nodes keeps all three).
        self._fixed = {
            "rank": rank, "pod": pod, "node": node, "restart": restart,
            "started": round(started if started is not None else time.time(), 3),
        }  # fmt: skip

    def record(self, stats: StepStats, *, checkpoint: bool) -> None:
        line = {
            "step": stats.step,
            **self._fixed,
            "computeSeconds": round(stats.compute_seconds, 6),
            "waitSeconds": round(stats.wait_seconds, 6),
            "checkpoint": checkpoint,
        }
        self._fh.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._fh.close()


def build_step_trace(env: RuntimeEnv, *, rank: int) -> StepTrace:
    if env.step_trace_dir is None:
        return NoOpStepTrace()
    return JsonlStepTrace(
        env.step_trace_dir,
        rank=rank,
        pod=env.pod_name,
        node=env.node_name,
        restart=env.restart_count,
    )
