"""Training progress from the trainers' Prometheus metrics, merged into status (pure)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

from finetune_operator.api import metricnames as mn
from finetune_operator.api.constants import (
    METRICS_BASE_PORT,
    REASON_CHECKPOINT_SKIPPED,
    checkpoint_dir_name,
)
from finetune_operator.api.status import CheckpointRef, FineTuneJobStatus
from finetune_operator.reconcile.conditions import EventSpec
from finetune_operator.reconcile.observed import RUNNING, PodView, format_time

STEP = mn.TRAINER_STEP.name
LOSS = mn.TRAINER_LOSS.name
CKPT_STEP = mn.TRAINER_LAST_CHECKPOINT_STEP.name
CKPT_TIME = mn.TRAINER_LAST_CHECKPOINT_TIME.name
CKPT_FAILURES = mn.TRAINER_CHECKPOINT_FAILURES.name
CKPT_FAILED_STEP = mn.TRAINER_LAST_FAILED_CHECKPOINT_STEP.name
RESUMED = mn.TRAINER_RESUMED_FROM_STEP.name
MAX_SKIPPED = 10  # status keeps the newest few
SKIPPED = mn.TRAINER_SKIPPED_CHECKPOINT_STEP.name
TOKENS = mn.TRAINER_TOKENS.name
# The trainer's own count: with `epochs` instead of `maxSteps` only it knows (from the data).
TOTAL = mn.TRAINER_TOTAL_STEPS.name


@dataclass(frozen=True)
class ScrapeTarget:
    pod: str
    url: str
    local_rank: int
    node: str | None = None
    uid: str = ""  # the pod's: a replacement keeps the name


@dataclass(frozen=True)
class TrainerProgress:
    step: int | None = None
    loss: float | None = None
    loss_rank: int | None = None  # the rank whose loss we report: the lowest one seen
    checkpoint_step: int | None = None
    checkpoint_time: float | None = None
    # Failed saves: the most any rank counted, and the newest failed step (None: none seen).
    checkpoint_failures: int | None = None
    checkpoint_failed_step: int | None = None
    resumed_from_step: int | None = None  # where the running trainers started (0: fresh)
    skipped_checkpoint: int | None = None  # newest checkpoint they found unusable
    total_steps: int | None = None


def scrape_targets(pods: Sequence[PodView], processes_per_pod: int) -> list[ScrapeTarget]:
    """Every local rank's endpoint (port 9400 + local rank) of each running worker pod."""
    return [
        ScrapeTarget(p.name, f"http://{p.ip}:{METRICS_BASE_PORT + r}/metrics", r, p.node, p.uid)
        for p in pods
        if p.is_worker and p.phase == RUNNING and p.ip and not p.terminating
        for r in range(processes_per_pod)
    ]


def _rank(labels: dict[str, str]) -> int:
    try:
        return int(labels.get("rank", ""))
    except ValueError:
        return 1 << 30  # unlabelled samples lose to any ranked one


Num = TypeVar("Num", int, float)


def _max(a: Num | None, b: Num | None) -> Num | None:
    return b if a is None else a if b is None else max(a, b)


# The gauges whose highest value over the ranks is the job's.
_HIGHEST = frozenset(
    {STEP, CKPT_STEP, CKPT_TIME, CKPT_FAILURES, CKPT_FAILED_STEP, RESUMED, SKIPPED, TOTAL}
)


def parse_trainer_metrics(text: str) -> TrainerProgress:
    """The progress one metrics page reports; an unparsable page reports nothing."""
    top: dict[str, float] = {}  # per gauge in _HIGHEST, its highest finite value
    loss: float | None = None
    loss_rank: int | None = None
    tokens: float | None = None
    try:
        samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    except (ValueError, TypeError, IndexError):
        return TrainerProgress()
    for s in samples:
        if not math.isfinite(s.value) and s.name != LOSS:
            continue
        if s.name in _HIGHEST:
            top[s.name] = max(top[s.name], s.value) if s.name in top else s.value
        elif s.name == LOSS and (loss_rank is None or _rank(s.labels) < loss_rank):
            loss, loss_rank = s.value, _rank(s.labels)
        elif s.name == TOKENS:
            tokens = (tokens or 0.0) + s.value
    if tokens == 0:
        # No step yet in this process (its tokens counter counts every step's): the loss
        # gauge's 0 is its initial value, not a loss ("step 0/60  loss 0.0000").
        loss = loss_rank = None
    step, ckpt_step, ckpt_time = top.get(STEP), top.get(CKPT_STEP), top.get(CKPT_TIME)
    failures, failed_step = top.get(CKPT_FAILURES), top.get(CKPT_FAILED_STEP)
    resumed, skipped, total = top.get(RESUMED), top.get(SKIPPED), top.get(TOTAL)
    return TrainerProgress(
        step=int(step) if step is not None else None,
        loss=loss,
        loss_rank=loss_rank,
        # Until its first save the trainer's gauge reads -1 (or 0): no checkpoint yet.
        checkpoint_step=int(ckpt_step) if ckpt_step is not None and ckpt_step > 0 else None,
        checkpoint_time=ckpt_time if ckpt_time else None,
        checkpoint_failures=int(failures) if failures is not None else None,
        checkpoint_failed_step=int(failed_step) if failed_step else None,
        resumed_from_step=int(resumed) if resumed is not None and resumed >= 0 else None,
        total_steps=int(total) if total is not None and total > 0 else None,
        skipped_checkpoint=int(skipped) if skipped else None,
    )


OWN_ROUND = mn.TRAINER_OWN_FAILURE_ROUND.name
CURRENT_ROUND = mn.TRAINER_ROUND.name


def _rounds(text: str, sample: str) -> list[str]:
    """The `round` labels of the samples named `sample` that are set (not 0) on one metrics
    page; none when the page does not parse."""
    try:
        samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    except (ValueError, TypeError, IndexError):
        return []
    found = [s.labels.get(mn.LABEL_ROUND) for s in samples if s.name == sample and s.value]
    return [r for r in found if r]


def parse_own_rounds(text: str) -> frozenset[str] | None:
    """The failed rounds one metrics page reports (every rank of a pod exports its launcher's
    list: `round` labels of the samples at 1), None when the page has none."""
    return frozenset(_rounds(text, OWN_ROUND)) or None


def own_rounds_by_pod(pages: Mapping[ScrapeTarget, str]) -> dict[str, frozenset[str]]:
    """Each scraped pod's failed rounds (the union over its ranks' pages), by uid."""
    out: dict[str, frozenset[str]] = {}
    for target, text in pages.items():
        rounds = parse_own_rounds(text)
        if rounds and target.uid:
            out[target.uid] = out.get(target.uid, frozenset()) | rounds
    return out


def parse_round(text: str) -> str | None:
    """The round one metrics page says its rank trains in (None: none, or not parseable)."""
    return next(iter(_rounds(text, CURRENT_ROUND)), None)


def rounds_by_pod(pages: Mapping[ScrapeTarget, str]) -> dict[str, str]:
    """The round each scraped pod trains in (its ranks agree on it), by uid."""
    out: dict[str, str] = {}
    for target, text in pages.items():
        found = parse_round(text)
        if found and target.uid:
            out[target.uid] = found
    return out


def parse_termination_message(text: str | None) -> TrainerProgress:
    """A worker's final report (the trainer writes JSON to its termination log on exit):
    what the last scrape may have missed, e.g. the final step and checkpoint. Anything that is
    not that JSON (a log tail from FallbackToLogsOnError) reports nothing."""
    try:
        data = json.loads(text or "")
    except ValueError:
        return TrainerProgress()
    if not isinstance(data, dict):
        return TrainerProgress()

    def number(key: str) -> float | None:
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return float(value) if math.isfinite(value) else None

    step, ckpt, loss, when, resumed = (
        number(k) for k in ("step", "checkpointStep", "loss", "checkpointTime", "resumedFromStep")
    )
    failed = number("checkpointFailedStep")
    skipped_list = data.get("skippedCheckpoints")
    skipped = (
        [int(v) for v in skipped_list if isinstance(v, int) and not isinstance(v, bool)]
        if isinstance(skipped_list, list)
        else []
    )
    return TrainerProgress(
        step=int(step) if step is not None else None,
        loss=loss,
        loss_rank=int(number("rank") or 0) if loss is not None else None,
        checkpoint_step=int(ckpt) if ckpt is not None and ckpt > 0 else None,
        checkpoint_time=when or None,
        checkpoint_failed_step=int(failed) if failed else None,
        # A final report only says what the trainer that wrote it resumed from; absent: fresh.
        resumed_from_step=int(resumed)
        if resumed is not None
        else (0 if step is not None else None),
        skipped_checkpoint=max(skipped) if skipped else None,
    )


def parse_trainer_error(text: str | None) -> str | None:
    """The configuration error a trainer left in its termination report (`error`), if any."""
    try:
        data = json.loads(text or "")
    except ValueError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    return error if isinstance(error, str) and error else None


def combine_progress(parts: Iterable[TrainerProgress]) -> TrainerProgress:
    """All ranks together: the furthest step and checkpoint, the lowest rank's loss."""
    out = TrainerProgress()
    for p in parts:
        better_loss = p.loss is not None and (
            out.loss_rank is None or (p.loss_rank is not None and p.loss_rank < out.loss_rank)
        )
        out = TrainerProgress(
            step=_max(out.step, p.step),
            loss=p.loss if better_loss else out.loss,
            loss_rank=p.loss_rank if better_loss else out.loss_rank,
            checkpoint_step=_max(out.checkpoint_step, p.checkpoint_step),
            checkpoint_time=_max(out.checkpoint_time, p.checkpoint_time),
            checkpoint_failures=_max(out.checkpoint_failures, p.checkpoint_failures),
            checkpoint_failed_step=_max(out.checkpoint_failed_step, p.checkpoint_failed_step),
            resumed_from_step=_max(out.resumed_from_step, p.resumed_from_step),
            skipped_checkpoint=_max(out.skipped_checkpoint, p.skipped_checkpoint),
            total_steps=_max(out.total_steps, p.total_steps),
        )
    return out


def merge_progress(
    status: FineTuneJobStatus, progress: TrainerProgress, checkpoint_uri: str
) -> FineTuneJobStatus:
    """Status with the trainers' progress; fields nobody reported keep their last value."""
    update: dict[str, object] = {}
    if progress.step is not None:
        update["step"] = progress.step
    if progress.total_steps is not None and status.total_steps is None:
        # An `epochs` job: its status said "step 198/?" to the end (maxSteps, when set, is
        # written from the spec and stays).
        update["total_steps"] = progress.total_steps
    if progress.loss is not None and math.isfinite(progress.loss):
        update["loss"] = progress.loss
    if progress.checkpoint_step is not None:
        when = (
            format_time(datetime.fromtimestamp(progress.checkpoint_time, UTC))
            if progress.checkpoint_time
            else None
        )
        uri = f"{checkpoint_uri.rstrip('/')}/{checkpoint_dir_name(progress.checkpoint_step)}"
        update["last_checkpoint"] = CheckpointRef(step=progress.checkpoint_step, uri=uri, time=when)
    if progress.resumed_from_step is not None:
        update["resumed_from_step"] = progress.resumed_from_step
    skipped = progress.skipped_checkpoint
    if skipped is not None and skipped not in status.skipped_checkpoints:
        update["skipped_checkpoints"] = [*status.skipped_checkpoints, skipped][-MAX_SKIPPED:]
    return status.model_copy(update=update) if update else status


def progress_events(old: FineTuneJobStatus, new: FineTuneJobStatus) -> list[EventSpec]:
    """A Warning for each checkpoint the trainers newly skipped as unusable."""
    fresh = [s for s in new.skipped_checkpoints if s not in old.skipped_checkpoints]
    return [
        EventSpec(
            "Warning",
            REASON_CHECKPOINT_SKIPPED,
            f"checkpoint step {s} failed verification or would not load; resumed from step "
            f"{new.resumed_from_step or 0} instead",
        )
        for s in fresh
    ]
