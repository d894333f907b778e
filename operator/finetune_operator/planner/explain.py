"""The Plan's `reason`: why this configuration, or what was tried and what would fit."""

from __future__ import annotations

from typing import Protocol

from finetune_operator.planner.errors import PlanningError
from finetune_operator.planner.hardware import GIB
from finetune_operator.planner.search import MIN_HEADROOM, Evaluated, Problem, SearchResult


class HintSearch(Protocol):
    def __call__(self, p: Problem, **changes: object) -> Evaluated | None: ...


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _config(ev: Evaluated) -> str:
    ck = "full checkpointing" if ev.shape.checkpointing else "no checkpointing"
    off = f", offload {ev.cand.offload}" if ev.cand.offload != "none" else ""
    return (
        f"{ev.cand.strategy}{off}, micro-batch {ev.shape.micro_batch} x "
        f"{ev.shape.grad_accumulation} accumulation, {ck}"
    )


def _device(p: Problem) -> str:
    return "CPU process" if not p.acc.cuda else f"{p.acc.name} GPU"


def explain_choice(p: Problem, result: SearchResult, best: Evaluated, launch_n: int) -> str:
    b = best.est.breakdown
    mem = p.acc.memory_bytes
    res = p.spec.resources
    smaller = [n for n in sorted(result.tried) if n < best.cand.world_size]
    lines = [
        f"{best.cand.world_size} x {_device(p)}: {_config(best)}; needs {_gib(b.total)} of "
        f"{_gib(mem)} ({1 - b.total / mem:.0%} headroom, peak at {best.est.peak_phase}); "
        f"modelled {best.step_s:.3g} s/step."
    ]
    if smaller:
        tried = ", ".join(f"{n} ({_gib(result.tried[n])})" for n in smaller)
        lines.append(f"Fewer ranks do not fit with {MIN_HEADROOM:.0%} headroom: {tried}.")
    if res.min_nodes is not None:
        lines.append(
            f"Elastic {res.min_nodes}-{res.max_nodes or res.min_nodes} nodes: launches "
            f"{launch_n // min(res.gpus_per_node, launch_n)} pods ({launch_n} ranks); memory checked "
            f"at minNodes ({best.cand.world_size} ranks) because sharded states and the per-rank "
            "batch grow when ranks leave."
        )
    elif p.spec.strategy.type != "auto":
        lines.append(f"Strategy pinned to {p.spec.strategy.type}.")
    lines.append(
        f"Fastest of the configurations that fit at this size ({result.evaluated} evaluated)."
    )
    return " ".join(lines)


def _try(hint: HintSearch, p: Problem, **changes: object) -> Evaluated | None:
    try:
        return hint(p, **changes)
    except PlanningError:
        return None


def explain_refusal(p: Problem, result: SearchResult, hint_problem: HintSearch) -> str:
    """What was tried, the smallest need found and the changes that would make it fit."""
    sm = result.smallest
    assert sm is not None  # plan_job refuses earlier when nothing was evaluated
    limit = p.acc.memory_bytes * (1 - MIN_HEADROOM)
    sizes = ", ".join(str(n) for n in sorted(result.tried))
    parts = [
        f"Nothing fits in {_gib(p.acc.memory_bytes)} per {_device(p)} with "
        f"{MIN_HEADROOM:.0%} headroom (limit {_gib(limit)}). Tried world sizes {sizes} "
        f"({result.evaluated} configurations); the smallest need was {_gib(sm.est.breakdown.total)} "
        f"at {sm.cand.world_size} ranks with {_config(sm)} (peak at {sm.est.peak_phase})."
    ]
    if sm.est.host_bytes > p.host_budget:
        parts.append(
            f"Offloaded states need {_gib(sm.est.host_bytes)} of host RAM per process "
            f"(budget {_gib(p.host_budget)})."
        )
    more = _try(hint_problem, p, unbounded=True)
    if more is not None and more.cand.world_size > max(result.tried, default=0):
        parts.append(
            f"Needs >= {more.cand.world_size} GPUs of this memory "
            f"({more.cand.strategy}; globalBatchSize divisible by that count)."
        )
    if p.spec.strategy.offload == "none" and p.acc.cuda:
        off = _try(hint_problem, p, offload=True)
        if off is not None:
            parts.append(
                f"strategy.offload: cpu would fit on {off.cand.world_size} GPUs "
                f"({off.cand.strategy})."
            )
    if p.spec.method.type == "full":
        for method, label in (("lora", "LoRA"), ("qlora", "QLoRA")):
            ev = _try(hint_problem, p, method=method)
            if ev is not None:
                parts.append(f"{label} would fit on {ev.cand.world_size} x {p.acc.name}.")
    need = sm.est.breakdown.total / (1 - MIN_HEADROOM)
    what = "GPU" if p.acc.cuda else "resources.memory per process of"
    parts.append(f"A {what} with >= {need / GIB:.0f} GiB would fit the smallest configuration.")
    return " ".join(parts)
