"""What `ftjob stragglers` prints: the `-o json` document and the human table."""

from __future__ import annotations

from typing import Any

from finetune_operator.stragglers.types import Detection, Policy, Verdict


def verdict_to_json(v: Verdict) -> dict[str, Any]:
    return {
        "rank": v.rank,
        "pod": v.pod,
        "node": v.node,
        "detectedAtStep": v.detected_at_step,
        "ratio": round(v.ratio, 4),
        "waitRatio": None if v.wait_ratio is None else round(v.wait_ratio, 4),
        "window": v.window,
        "epochStartStep": v.epoch_start_step,
    }


def detection_to_json(d: Detection, policy: Policy, *, records: int) -> dict[str, Any]:
    """Every verdict, earlier epochs first (each names the pod/node of its epoch)."""
    return {
        "stragglers": [verdict_to_json(v) for v in d.all_verdicts],
        "records": records,
        "policy": {
            "threshold": policy.threshold,
            "windowSteps": policy.window_steps,
            "consecutiveWindows": policy.consecutive_windows,
            "warmupSteps": policy.warmup_steps,
        },
    }


def render_table(d: Detection, policy: Policy, *, records: int) -> str:
    rule = (
        f"threshold {policy.threshold:g}x, {policy.window_steps}-step windows, "
        f"{policy.consecutive_windows} in a row"
    )
    if not d.all_verdicts:
        return f"no straggler in {records} records ({rule})"
    head = ("RANK", "POD", "NODE", "STEP", "RATIO", "WAIT RATIO", "EPOCH FROM")
    rows = [head] + [
        (
            str(v.rank),
            v.pod or "-",
            v.node or "-",
            str(v.detected_at_step),
            f"{v.ratio:.2f}x",
            "-" if v.wait_ratio is None else f"{v.wait_ratio:.2f}",
            str(v.epoch_start_step),
        )
        for v in d.all_verdicts
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([*lines, f"{len(d.all_verdicts)} straggler(s) in {records} records ({rule})"])
