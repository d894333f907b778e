"""Fault injection for tests and drills: make this rank slow or hung, the way a slow GPU or a
stuck NCCL kernel would. A no-op object unless its environment variables are set, so the loop
calls it unconditionally (no `if` in the hot path).

- `FT_STEP_DELAY_SECONDS` (float, default 0): each step takes this much longer, spread over its
  micro-batches and counted as this rank's compute (a slow device). On the local cluster a
  virtual node can carry it for every pod it runs (a slow node).
- `FT_HANG_AT_STEP` (int): at this step the rank stops making progress, forever (no heartbeat,
  no step), until it is killed. Once per marker file: the hang first creates
  `FT_HANG_MARKER` (default `.ft-hang-marker` in the working directory), and a rank that finds
  it runs normally, so a restarted job recovers (a transient fault).
- `FT_GRAD_OVERFLOW_AT_STEP` (int) and `FT_GRAD_OVERFLOW_RANK` (int, default 0): at this step,
  after backward and the gradient reduction, that rank writes inf into one element of its own
  gradient (its shard under FSDP): an fp16 overflow only this rank sees. Loss scaling must
  make every rank skip the step (finetune_trainer.loss_scale); without it the run diverges.
- `FT_CRASH_AT_STEP` (int), `FT_CRASH_RANK` (int, default 0) and `FT_CRASH_KIND`
  (`exception`, the default: a RuntimeError, as a bug or a bad data row raises; `oom`: a
  `torch.OutOfMemoryError`, as the caching allocator raises when the GPU is full; `kill`:
  SIGKILL to itself, as the kernel's OOM killer does): in that step's first micro-batch that
  rank fails, every time it gets there (a persistent fault). What the job's status then says
  is the subject (finetune_trainer/crash.py).
- `FT_DATA_DELAY_SECONDS` (float) and `FT_DATA_DELAY_RANK` (int, default 0): that rank's data
  phase (reading and tokenizing the corpus, or the data cache's build) takes this much longer,
  as a large corpus or a slow node's would while its peers wait for it
  (finetune_trainer/startup_barrier.py): slow but steady, its start-up progress moving all along.
- `FT_DATA_STALL_SECONDS` (float): after that delay, the same rank's data phase makes no
  progress for this long, still beating: a download socket or an NFS read that hangs. Past
  the startup timeout the barrier ends it as stuck.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from finetune_trainer import startup_progress

DEFAULT_HANG_MARKER = ".ft-hang-marker"
CRASH_KINDS = ("exception", "oom", "kill")


def env_number(
    env: Mapping[str, str], name: str, kind: type[float] | type[int] = float
) -> float | None:
    """A non-negative number from the environment (None: unset); a clear error otherwise."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from e
    if value < 0:
        raise ValueError(f"environment variable {name}={raw!r} must be >= 0")
    return value


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    step_delay_seconds: float = 0.0
    hang_at_step: int | None = None
    hang_marker: Path = Path(DEFAULT_HANG_MARKER)
    overflow_at_step: int | None = None
    overflow_rank: int = 0
    crash_at_step: int | None = None
    crash_rank: int = 0
    crash_kind: str = "exception"
    data_delay_seconds: float = 0.0
    data_delay_rank: int = 0
    data_stall_seconds: float = 0.0

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> FaultConfig:
        delay = env_number(env, "FT_STEP_DELAY_SECONDS", float)
        hang = env_number(env, "FT_HANG_AT_STEP", int)
        overflow = env_number(env, "FT_GRAD_OVERFLOW_AT_STEP", int)
        crash = env_number(env, "FT_CRASH_AT_STEP", int)
        kind = env.get("FT_CRASH_KIND", "").strip() or "exception"
        if kind not in CRASH_KINDS:
            raise ValueError(
                f"environment variable FT_CRASH_KIND={kind!r} must be one of {CRASH_KINDS}"
            )
        return cls(
            step_delay_seconds=float(delay or 0.0),
            hang_at_step=int(hang) if hang is not None else None,
            hang_marker=Path(env.get("FT_HANG_MARKER") or DEFAULT_HANG_MARKER),
            overflow_at_step=int(overflow) if overflow is not None else None,
            overflow_rank=int(env_number(env, "FT_GRAD_OVERFLOW_RANK", int) or 0),
            crash_at_step=int(crash) if crash is not None else None,
            crash_rank=int(env_number(env, "FT_CRASH_RANK", int) or 0),
            crash_kind=kind,
            data_delay_seconds=float(env_number(env, "FT_DATA_DELAY_SECONDS", float) or 0.0),
            data_delay_rank=int(env_number(env, "FT_DATA_DELAY_RANK", int) or 0),
            data_stall_seconds=float(env_number(env, "FT_DATA_STALL_SECONDS", float) or 0.0),
        )

    @property
    def enabled(self) -> bool:
        return (
            self.step_delay_seconds > 0
            or self.hang_at_step is not None
            or self.overflow_at_step is not None
            or self.crash_at_step is not None
            or self.data_delay_seconds > 0
            or self.data_stall_seconds > 0
        )


class Faults(Protocol):
    def after_data(self) -> None:
        """Called once the rank's training blocks are ready (before it meets its peers)."""

    def after_micro_batch(self, step: int, micro_batches: int) -> None:
        """Called after each micro-batch's backward of optimizer step `step` (1-based)."""

    def before_optimizer_step(self, step: int, model: nn.Module) -> None:
        """Called with step `step`'s reduced gradients, before they are unscaled or clipped."""


class NoFaults:
    def after_data(self) -> None:
        return None

    def after_micro_batch(self, step: int, micro_batches: int) -> None:
        return None

    def before_optimizer_step(self, step: int, model: nn.Module) -> None:
        return None


class InjectedFaults:
    def __init__(self, config: FaultConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank

    def after_data(self) -> None:
        if self.rank != self.config.data_delay_rank:
            return
        with startup_progress.phase("data"):
            end = time.monotonic() + self.config.data_delay_seconds
            while time.monotonic() < end:  # slow work that advances
                time.sleep(min(0.1, max(0.0, end - time.monotonic())))
                startup_progress.advance()
            time.sleep(self.config.data_stall_seconds)  # then none

    def before_optimizer_step(self, step: int, model: nn.Module) -> None:
        if step != self.config.overflow_at_step or self.rank != self.config.overflow_rank:
            return
        for p in model.parameters():
            grad = p.grad
            if grad is None:
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2: DTensor
            if local.numel():
                with torch.no_grad():
                    local.view(-1)[0] = float("inf")
                return

    def after_micro_batch(self, step: int, micro_batches: int) -> None:
        if step == self.config.crash_at_step and self.rank == self.config.crash_rank:
            self._crash(step)
        if self.config.step_delay_seconds:
            time.sleep(self.config.step_delay_seconds / max(micro_batches, 1))
        if step == self.config.hang_at_step and self._claim_hang():
            while (
                True
            ):  # SIGTERM only sets the stop flag: like a stuck kernel, only SIGKILL ends it
                time.sleep(3600)

    def _crash(self, step: int) -> None:
        kind = self.config.crash_kind
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "oom":
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB (injected at step {step})"
            )
        raise RuntimeError(f"injected fault at step {step} on rank {self.rank}")

    def _claim_hang(self) -> bool:
        try:
            self.config.hang_marker.touch(exist_ok=False)
        except FileExistsError:
            return False
        return True


def build_faults(config: FaultConfig, rank: int = 0) -> Faults:
    return InjectedFaults(config, rank) if config.enabled else NoFaults()
