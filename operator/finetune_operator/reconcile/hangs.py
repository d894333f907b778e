"""Hang detection (pure, `now` passed in): no step progress on any rank, or a rank whose
heartbeat went stale, for `faultTolerance.hangTimeoutSeconds`.

The trainer's heartbeat gauge moves at every micro-batch, so a slow step still beats; a rank
stuck in a kernel or a collective does not (nor do the peers blocked waiting for it: the
oldest heartbeat names the culprit). A job is only judged while all its workers run and
report metrics: a re-form, a pending pod or an unreachable endpoint is not a hang.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from finetune_operator.api.constants import REASON_NO_HANG, REASON_NO_PROGRESS, REASON_RANK_HUNG
from finetune_operator.api.status import Condition
from finetune_operator.reconcile.conditions import Want
from finetune_operator.reconcile.observed import format_time, parse_time
from finetune_operator.reconcile.samples import RankSample

PROGRESSING = Want("False", REASON_NO_HANG, "training progresses")


@dataclass(frozen=True)
class HangDecision:
    last_progress_time: str | None
    condition: Want
    hung: bool = False


def decide_hang(
    timeout_seconds: float,
    samples: Sequence[RankSample],
    step_before: int | None,
    step_now: int | None,
    last_progress_time: str | None,
    old_condition: Condition | None,
    *,
    judging: bool,
    now: datetime,
) -> HangDecision:
    keep = (
        Want(old_condition.status, old_condition.reason)
        if old_condition is not None and old_condition.status == "True"
        else PROGRESSING
    )
    if not judging or not samples:
        return HangDecision(None, keep)  # the clock starts again when training can progress
    progressed = step_now is not None and step_now != step_before
    since = parse_time(last_progress_time)
    if progressed or since is None:
        return HangDecision(format_time(now), PROGRESSING if progressed else keep)
    limit = timedelta(seconds=timeout_seconds)
    beats = [s for s in samples if s.heartbeat is not None]
    oldest = min(beats, key=lambda s: s.heartbeat or 0.0, default=None)
    if oldest is not None and oldest.heartbeat is not None:
        silent = now.timestamp() - oldest.heartbeat
        if silent > timeout_seconds:
            where = f"pod {oldest.pod}" + (f" on node {oldest.node}" if oldest.node else "")
            msg = (
                f"rank {oldest.rank} ({where}) has not made progress for {silent:.0f}s "
                f"(hangTimeoutSeconds {timeout_seconds:g}): restarting the workers from the "
                "last committed checkpoint"
            )
            return HangDecision(None, Want("True", REASON_RANK_HUNG, msg), hung=True)
    if now - since > limit:
        msg = (
            f"no rank's step advanced since {last_progress_time} (hangTimeoutSeconds "
            f"{timeout_seconds:g}): restarting the workers from the last committed checkpoint"
        )
        return HangDecision(None, Want("True", REASON_NO_PROGRESS, msg), hung=True)
    return HangDecision(last_progress_time, keep)
