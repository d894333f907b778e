"""What the trainer is told: the job config the operator wrote, plus the process environment
that torchrun and the pod give it (ranks, world size, pod address, test knobs)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from finetune_operator.api.constants import FINAL_SAVE_GRACE_SECONDS, METRICS_BASE_PORT
from finetune_operator.api.jobconfig import JobConfig
from finetune_trainer.crash import OWN_ROUNDS_ENV, parse_rounds
from finetune_trainer.faults import FaultConfig, env_number


def load_job_config(path: str | os.PathLike[str]) -> JobConfig:
    """Read and validate `job.json` (camelCase, as the operator writes it)."""
    return JobConfig.model_validate_json(Path(path).read_text(encoding="utf-8"))


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    value = env_number(env, name)
    return default if value is None else float(value)


@dataclass(frozen=True, kw_only=True)
class RuntimeEnv:
    """Per-process facts from the environment, read once at start.

    Test/operations knobs (all optional):
    - `FT_STEP_DELAY_SECONDS`, `FT_HANG_AT_STEP`, `FT_HANG_MARKER`, `FT_GRAD_OVERFLOW_AT_STEP`,
      `FT_GRAD_OVERFLOW_RANK`, `FT_CRASH_AT_STEP`, `FT_CRASH_RANK`, `FT_CRASH_KIND`,
      `FT_DATA_DELAY_SECONDS`, `FT_DATA_DELAY_RANK`, `FT_DATA_STALL_SECONDS`: fault injection
      (a slow or hung rank, an fp16 gradient overflow on one rank, a rank that crashes, a rank
      slow to tokenize or stuck while starting), see
      `finetune_trainer.faults`.
    - `FT_GRACE_SECONDS` (float, default 25): after SIGTERM, how long the final checkpoint may
      take; torchrun SIGKILLs workers 30 s after it forwards SIGTERM.
    - `FT_METRICS_BASE_PORT` (int, default 9400): metrics port of local rank 0; `0` disables
      the metrics HTTP server.
    - `FINETUNE_STEP_TRACE_DIR` (path, default unset): each rank appends one line per step to
      `<dir>/rank-<rank>.jsonl`, the trace `ftjob stragglers` replays (see `steptrace.py`).
    - `FT_COMPILE` (`1`/`0`, default 1): torch.compile the decoder blocks on CUDA devices
      (never on CPU); `0` runs eager, e.g. to rule compilation out when debugging.
    - `FT_DATA_CACHE_DIR` (path, default unset: no cache) and `FT_DATA_CACHE_LIMIT_BYTES`
      (int, default unset: the volume's free space): where the tokenized blocks are cached
      across restarts and how much they may take (`finetune_trainer.data.cache`); the worker
      pod sets both for its `data-cache` emptyDir.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    restart_count: int
    pod_ip: str | None
    pod_name: str | None
    faults: FaultConfig
    grace_seconds: float
    metrics_base_port: int
    node_name: str | None = None  # NODE_NAME from the downward API
    step_trace_dir: Path | None = None
    compile: bool = True
    data_cache_dir: Path | None = None
    data_cache_limit_bytes: int | None = None
    # The workers share their agent's store, the same in every rendezvous round
    # (TORCHELASTIC_USE_AGENT_STORE; finetune_trainer.startup_barrier.round_name).
    agent_store: bool = False
    # The rendezvous rounds whose failure of the pod's own torchrun restarted the group
    # after (finetune_trainer.crash.OWN_ROUNDS_ENV, set by the launcher).
    own_rounds: tuple[str, ...] = ()

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> RuntimeEnv:
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(env.get("RANK", "0")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=world,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            own_rounds=parse_rounds(env.get(OWN_ROUNDS_ENV)),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            pod_ip=env.get("POD_IP") or None,
            pod_name=env.get("POD_NAME") or None,
            faults=FaultConfig.from_environ(env),
            grace_seconds=_float(env, "FT_GRACE_SECONDS", FINAL_SAVE_GRACE_SECONDS),
            metrics_base_port=int(env.get("FT_METRICS_BASE_PORT", str(METRICS_BASE_PORT))),
            node_name=env.get("NODE_NAME") or None,
            step_trace_dir=Path(raw) if (raw := env.get("FINETUNE_STEP_TRACE_DIR")) else None,
            compile=env.get("FT_COMPILE", "1").strip() != "0",
            data_cache_dir=Path(raw) if (raw := env.get("FT_DATA_CACHE_DIR")) else None,
            data_cache_limit_bytes=int(raw)
            if (raw := env.get("FT_DATA_CACHE_LIMIT_BYTES"))
            else None,
        )

    @property
    def metrics_port(self) -> int | None:
        if self.metrics_base_port == 0:
            return None
        return self.metrics_base_port + self.local_rank
