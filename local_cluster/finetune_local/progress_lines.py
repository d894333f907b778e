"""Progress of a FineTuneJob as text lines, from its status alone (pure: `now` is passed in)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JobObject = dict[str, Any]


def tokens_per_step(job: JobObject) -> int:
    training = job.get("spec", {}).get("training", {})
    return int(training.get("globalBatchSize", 0)) * int(training.get("sequenceLength", 0))


@dataclass
class ProgressTracker:
    """Turns successive observations of a job into progress lines, one per change."""

    started: float
    last_line: str = ""
    _rate_from: tuple[float, int] | None = field(default=None, repr=False)
    _last_step: int = field(default=-1, repr=False)
    tokens_per_second: float = 0.0

    def observe(self, job: JobObject, now: float) -> str | None:
        status = job.get("status", {})
        step = status.get("step")
        if isinstance(step, int):
            self._update_rate(step, tokens_per_step(job), now)
        line = self.render(status)
        if line == self.last_line:
            return None
        self.last_line = line
        return f"[{now - self.started:6.1f}s] {line}"

    def _update_rate(self, step: int, per_step: int, now: float) -> None:
        """Tokens/s between the first and the latest *change* of step (a rate measured at
        every poll would decay while the step stands still between two scrapes); a step that
        goes back (a restart resumed from a checkpoint) starts a new measurement."""
        if self._rate_from is None or step < self._rate_from[1]:
            self._rate_from = (now, step)
            self._last_step = step
            return
        if step == self._last_step:
            return
        self._last_step = step
        since, first = self._rate_from
        if now > since:
            self.tokens_per_second = (step - first) * per_step / (now - since)

    def render(self, status: dict[str, Any]) -> str:
        parts = [f"{status.get('phase') or 'Pending':<10}"]
        step, total = status.get("step"), status.get("totalSteps")
        if step is not None:
            parts.append(f"step {step}/{total if total is not None else '?'}")
        if status.get("loss") is not None:
            parts.append(f"loss {float(status['loss']):.4f}")
        if self.tokens_per_second:
            parts.append(f"{self.tokens_per_second:,.0f} tok/s")
        if status.get("readyWorkers") is not None and status.get("plan"):
            parts.append(f"workers {status['readyWorkers']}/{status['plan'].get('nodes', '?')}")
        ckpt = status.get("lastCheckpoint")
        if ckpt:
            parts.append(f"checkpoint step {ckpt.get('step')}")
        parts.append(f"restarts {status.get('restarts', 0)}")
        blocked = _blocked_pod(status)
        if blocked:
            parts.append(f"waiting: {blocked}")
        return "  ".join(parts)


def _blocked_pod(status: dict[str, Any]) -> str | None:
    """The first 'pod x cannot start: why' of a False WorkersReady (a missing Secret, a pod
    no node takes): the display said only 'Pending  workers 0/2' until --timeout (30 minutes
    by default) printed the conditions."""
    for cond in status.get("conditions") or []:
        if cond.get("type") == "WorkersReady" and cond.get("status") == "False":
            parts = str(cond.get("message", "")).split("; ")
            return next((p for p in parts if " cannot start: " in p), None)
    return None


def _located(uri: str, workdir: Path | None) -> str:
    """A relative URI as the pods resolved it: against their working directory (the cluster's
    shared/), not the directory `ftjob` was started in."""
    if workdir is None or "://" in uri or uri.startswith("/"):
        return uri
    return str(workdir / uri)


def summarize(job: JobObject, workdir: Path | None = None) -> str:
    """The final report: phase, every condition, progress and where things are (relative URIs
    resolved against `workdir`, the pods' working directory, when given)."""
    status = job.get("status", {})
    lines = [f"FineTuneJob {job['metadata']['name']}: {status.get('phase', 'Unknown')}"]
    for cond in status.get("conditions", []):
        lines.append(
            f"  {cond['type']:<18} {cond['status']:<8} {cond.get('reason', '')}: "
            f"{cond.get('message', '')}"
        )
    if status.get("step") is not None:
        lines.append(f"  steps {status['step']}/{status.get('totalSteps', '?')}")
    ckpt = status.get("lastCheckpoint")
    if ckpt:
        where = _located(str(ckpt.get("uri")), workdir)
        lines.append(f"  last checkpoint: step {ckpt.get('step')} at {where}")
    output = (job.get("spec", {}).get("output") or {}).get("uri")
    if output and status.get("phase") == "Succeeded":
        lines.append(f"  trained model: {_located(str(output), workdir)}")
    lines.append(f"  restarts {status.get('restarts', 0)}")
    return "\n".join(lines)
