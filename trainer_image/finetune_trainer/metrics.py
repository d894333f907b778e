"""Prometheus metrics (one HTTP server per local rank) and what rank 0 writes to the JSON step log.

Labels are `finetunejob` and `rank` only: Prometheus owns `job`; namespace, pod and node come
from the scrape target. Throughput and memory maths live here, not in the loop.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from finetune_operator.api import metricnames as mn
from finetune_trainer.stall import Stall, StallEstimator
from finetune_trainer.steplog import write_json_line

log = logging.getLogger(__name__)

_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
_CKPT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)


@dataclass(frozen=True)
class StepStats:
    step: int
    loss: float
    lr: float
    tokens: int  # tokens this step, all ranks
    step_seconds: float
    compute_seconds: float
    wait_seconds: float
    loss_scale: float | None = None  # fp16's dynamic loss scale after this step


def peak_reserved_bytes(device: torch.device) -> int:
    """CUDA caching allocator's peak of reserved segments (what an OOM is decided on); 0 on CPU."""
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else 0


def _segments_by_stream() -> dict[str, list[int]]:
    """The caching allocator's segments now, per stream: [count, reserved, allocated] bytes
    (what the planner's reserved-memory model is checked against)."""
    out: dict[str, list[int]] = {}
    for seg in torch.cuda.memory_snapshot():
        key = f"{seg['stream']}:{seg['segment_type']}"
        row = out.setdefault(key, [0, 0, 0])
        row[0] += 1
        row[1] += int(seg["total_size"])
        row[2] += int(seg["allocated_size"])
    return out


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


class TrainerMetrics:
    def __init__(
        self,
        *,
        job: str,
        rank: int,
        device: torch.device,
        reforms: int,
        total_steps: int,
        own_rounds: Sequence[str] = (),
        round_id: str = "",
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.device = device
        self.rank = rank
        labels = {mn.LABEL_FINETUNEJOB: job, mn.LABEL_RANK: str(rank)}

        def gauge(m: mn.Metric) -> Gauge:
            return Gauge(m.family, m.help, m.labels, registry=self.registry).labels(**labels)

        def hist(m: mn.Metric, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                m.family, m.help, m.labels, registry=self.registry, buckets=buckets
            ).labels(**labels)

        self.step = gauge(mn.TRAINER_STEP)
        self.total_steps = gauge(mn.TRAINER_TOTAL_STEPS)
        self.loss = gauge(mn.TRAINER_LOSS)
        self.peak_memory = gauge(mn.TRAINER_PEAK_MEMORY)
        self.reforms = gauge(mn.TRAINER_REFORMS)
        self.last_ckpt_step = gauge(mn.TRAINER_LAST_CHECKPOINT_STEP)
        self.last_ckpt_time = gauge(mn.TRAINER_LAST_CHECKPOINT_TIME)
        self.heartbeat = gauge(mn.TRAINER_HEARTBEAT)
        # Tells this process from its successor (the operator never makes a step record across
        # two): torchelastic keeps the restart count when it restarts a group on a membership change.
        gauge(mn.TRAINER_PROCESS_START).set(time.time())
        self.resumed_from_step = gauge(mn.TRAINER_RESUMED_FROM_STEP)
        self.skipped_ckpt_step = gauge(mn.TRAINER_SKIPPED_CHECKPOINT_STEP)
        t = mn.TRAINER_TOKENS
        self.tokens = Counter(t.family, t.help, t.labels, registry=self.registry).labels(**labels)
        self.step_seconds = hist(mn.TRAINER_STEP_DURATION, _STEP_BUCKETS)
        self.compute_seconds = hist(mn.TRAINER_COMPUTE_DURATION, _STEP_BUCKETS)
        self.wait_seconds = hist(mn.TRAINER_WAIT_DURATION, _STEP_BUCKETS)
        self.ckpt_blocking = hist(mn.TRAINER_CHECKPOINT_BLOCKING, _CKPT_BUCKETS)
        self.ckpt_duration = hist(mn.TRAINER_CHECKPOINT_SAVE_DURATION, _CKPT_BUCKETS)
        self.ckpt_stall = hist(mn.TRAINER_CHECKPOINT_STALL, _CKPT_BUCKETS)
        f = mn.TRAINER_CHECKPOINT_FAILURES
        self.ckpt_failures = Counter(f.family, f.help, f.labels, registry=self.registry).labels(
            **labels
        )
        self.last_failed_ckpt_step = gauge(mn.TRAINER_LAST_FAILED_CHECKPOINT_STEP)
        self.reforms.set(reforms)
        # The pod's restarts after failures of its own (its launcher's), and the rounds they
        # failed in: every rank exports them, so one scraped rank is enough for the
        # operator's restart ledger (which counts each round once, whatever pods report it).
        gauge(mn.TRAINER_OWN_FAILURE_RESTARTS).set(len(own_rounds))
        r = mn.TRAINER_OWN_FAILURE_ROUND
        rounds = Gauge(r.family, r.help, r.labels, registry=self.registry)
        for failed in own_rounds:
            rounds.labels(**labels, **{mn.LABEL_ROUND: failed}).set(1)
        # The round this rank trains in: the operator remembers each pod's, so that the round
        # its peers fail in when it is lost with its node is not counted (nodeloss.py).
        r = mn.TRAINER_ROUND
        current = Gauge(r.family, r.help, r.labels, registry=self.registry)
        if round_id:
            current.labels(**labels, **{mn.LABEL_ROUND: round_id}).set(1)
        self.total_steps.set(total_steps)
        # Save durations for the run's final summary line (bench/gpu.py reads it).
        self._commit_seconds: list[float] = []
        self.stall = StallEstimator()
        # Set by the checkpoint commit thread, read by the loop: has the save in flight
        # finished writing? (A bool assignment is atomic under the GIL.)
        self._write_done = True
        self.stalls: list[Stall] = []  # every save's estimate, for benchmarks and tests

    def serve(self, port: int | None, addr: str | None) -> None:
        """Start the HTTP endpoint; a taken port is logged, never fatal to training."""
        self.beat()  # alive from the first scrape on, before the first step ends
        if port is None:
            return
        try:
            start_http_server(port, addr=addr or "0.0.0.0", registry=self.registry)
            log.info("metrics on http://%s:%d/metrics", addr or "0.0.0.0", port)
        except OSError as e:
            log.warning("metrics server not started on %s:%d: %s", addr, port, e)

    def observe_step(self, s: StepStats, world_size: int) -> None:
        self.step.set(s.step)
        self.loss.set(s.loss)
        self.tokens.inc(s.tokens // world_size)
        self.step_seconds.observe(s.step_seconds)
        self.compute_seconds.observe(s.compute_seconds)
        self.wait_seconds.observe(s.wait_seconds)
        self.peak_memory.set(peak_memory_bytes(self.device))
        self.observe_step_time(s.step_seconds)
        if self.rank == 0:
            line: dict[str, object] = {
                "step": s.step,
                "loss": round(s.loss, 5),
                "lr": s.lr,
                "tokens_per_second": round(s.tokens / max(s.step_seconds, 1e-9), 1),
                "step_seconds": round(s.step_seconds, 4),
                "compute_seconds": round(s.compute_seconds, 4),
                "wait_seconds": round(s.wait_seconds, 4),
            }
            if s.loss_scale is not None:
                line["loss_scale"] = s.loss_scale
            write_json_line(line)

    def _record_stalls(self, stalls: list[Stall | None]) -> None:
        for st in stalls:
            if st is not None:
                self.ckpt_blocking.observe(st.blocking)
                self.ckpt_stall.observe(st.stall)
                self.stalls.append(st)

    def observe_step_time(self, seconds: float) -> None:
        """Feed the checkpoint stall estimator (a step ran, maybe under a save in flight)."""
        self._record_stalls([self.stall.step(seconds, write_done=self._write_done)])

    def checkpoint_save_started(self) -> None:
        """Before a save hands anything to a background thread (so no completion is lost)."""
        self._record_stalls([self.stall.close()])
        self._write_done = False

    def checkpoint_save_returned(self, step: int, call_seconds: float) -> None:
        """The save call returned to the loop after `call_seconds`."""
        self._record_stalls(self.stall.save(step, call_seconds, write_done=self._write_done))

    def checkpoint_staging_waited(self, seconds: float) -> None:
        self.stall.staging_wait(seconds)

    def checkpoint_window_closed(self) -> None:
        """No more steps will run under the last save (end of run): report it now."""
        self._record_stalls([self.stall.close()])

    def beat(self) -> None:
        """The loop is alive: called at each micro-batch, so a slow step still beats and only a
        rank stuck (a hung kernel or collective) goes stale."""
        self.heartbeat.set(time.time())

    def observe_resume(self, step: int, skipped: list[int]) -> None:
        self.resumed_from_step.set(step)
        self.skipped_ckpt_step.set(max(skipped, default=0))

    def observe_checkpoint_committed(self, step: int, seconds: float) -> None:
        self.ckpt_duration.observe(seconds)
        self._commit_seconds.append(seconds)
        self.last_ckpt_step.set(step)
        self.last_ckpt_time.set(time.time())
        self._write_done = True

    def observe_checkpoint_failed(self, step: int) -> None:
        self.ckpt_failures.inc()
        self.last_failed_ckpt_step.set(step)
        self._write_done = True

    def log_summary(self) -> None:
        """Rank 0's last JSON line: the run's memory peaks and checkpoint times."""
        if self.rank != 0:
            return
        summary: dict[str, object] = {
            "peak_allocated_bytes": peak_memory_bytes(self.device),
            "peak_reserved_bytes": peak_reserved_bytes(self.device),
            "checkpoint_blocking_seconds": [round(s.blocking, 4) for s in self.stalls],
            "checkpoint_stall_seconds": [round(s.stall, 4) for s in self.stalls],
            "checkpoint_commit_seconds": [round(s, 4) for s in self._commit_seconds],
        }
        if self.device.type == "cuda":
            summary["segments_by_stream"] = _segments_by_stream()
        write_json_line({"summary": summary})
