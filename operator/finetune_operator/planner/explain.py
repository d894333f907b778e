"""The Plan's `reason`: why this configuration, or what was tried and what would fit."""

from __future__ import annotations

import math
from typing import Protocol

from finetune_operator.api.plan import Plan
from finetune_operator.planner.checkpoint_memory import SaveMemory
from finetune_operator.planner.errors import PlanningError
from finetune_operator.planner.hardware import GIB, MIB, runtime_host_bytes
from finetune_operator.planner.search import MIN_HEADROOM, Evaluated, Problem, SearchResult


class HintSearch(Protocol):
    def __call__(self, p: Problem, **changes: object) -> Evaluated | None: ...


def _gib(n: float) -> str:
    """GiB, or MiB below one GiB: a CPU toy's 5.8 MiB is not '0.0 GiB'."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def _gib_up(n: float) -> str:
    """As _gib, rounded up: a figure that "would fit" must not be shown below the need."""
    unit = GIB if n >= GIB else MIB
    return _gib(math.ceil(n / unit * 10) / 10 * unit)


def _count(n: int, word: str) -> str:
    """'1 rank', '8 ranks' ('pods', 'ranks': the words the reasons count)."""
    return f"{n} {word if n == 1 else word + 's'}"


def _config(ev: Evaluated) -> str:
    ck = (
        "full activation checkpointing" if ev.shape.checkpointing else "no activation checkpointing"
    )
    off = f", offload {ev.cand.offload}" if ev.cand.offloads else ""
    return (
        f"{ev.cand.strategy}{off}, micro-batch {ev.shape.micro_batch_size} x "
        f"{ev.shape.grad_accumulation} accumulation, {ck}"
    )


def _plan_config(plan: Plan) -> str:
    ck = (
        "full activation checkpointing"
        if plan.activation_checkpointing
        else "no activation checkpointing"
    )
    off = f", offload {plan.offload}" if plan.offload != "none" else ""
    return (
        f"{plan.strategy}{off}, micro-batch {plan.micro_batch_size} x "
        f"{plan.gradient_accumulation_steps} accumulation, {ck}"
    )


def _device(p: Problem) -> str:
    return "CPU process" if not p.acc.cuda else f"{p.acc.name} GPU"


def _per(p: Problem) -> str:
    return "per process" if not p.acc.cuda else "per GPU"


_OBJECTIVE_WORDS = {
    "fewest-gpus": "Objective fewest-gpus: the fastest of the configurations that fit at the "
    "smallest world size",
    "fastest": "Objective fastest: the shortest modelled step of the configurations that fit "
    "at any world size up to the GPU limit",
    "lowest-cost": "Objective lowest-cost: the fewest modelled GPU-hours of the configurations "
    "that fit at any world size up to the GPU limit",
}


def explain_choice(
    p: Problem, result: SearchResult, best: Evaluated, plan: Plan, objective: str
) -> str:
    """The reason, written from the Plan's own numbers (what runs: the launched world size
    and its accumulation), so the table, the reason and the Planned condition agree."""
    res = p.spec.resources
    mem = plan.gpu_memory_bytes
    elastic = res.min_nodes is not None and best.cand.world_size != plan.world_size
    lines = [
        f"{plan.world_size} x {_device(p)}: {_plan_config(plan)}; "
        # The need the headroom is of (on a CPU job with DeepSpeed offload, the offloaded
        # states too: the breakdown's total alone left them out).
        f"modelled {plan.estimated_step_seconds:.3g} s/step. Needs {_gib(best.device_need)} "
        f"of {_gib(mem)} {_per(p)} ({plan.headroom:.0%} headroom, peak at "
        f"{best.est.peak_phase})"
        + (
            f" at minNodes ({_count(best.cand.world_size, 'rank')}, micro-batch {best.shape.micro_batch_size} "
            f"x {best.shape.grad_accumulation} accumulation)."
            if elastic
            else "."
        )
    ]
    smaller = [n for n in sorted(result.tried) if n < best.cand.world_size]
    if smaller and objective == "fewest-gpus":
        tried = ", ".join(f"{n} ({_gib(result.tried[n])})" for n in smaller)
        lines.append(f"Fewer ranks do not fit with {MIN_HEADROOM:.0%} headroom: {tried}.")
    if res.min_nodes is not None and res.min_nodes != (res.max_nodes or res.min_nodes):
        lines.append(
            f"Elastic {res.min_nodes}-{res.max_nodes} nodes: launches "
            f"{_count(plan.nodes, 'pod')} ({_count(plan.world_size, 'rank')}); memory is checked at minNodes "
            "because sharded states and the per-rank batch grow when ranks leave."
        )
    elif res.min_nodes is not None:
        lines.append(
            f"minNodes = maxNodes fixes {_count(plan.nodes, 'pod')} "
            f"({_count(plan.world_size, 'rank')})."
        )
    if p.spec.strategy.type != "auto":
        lines.append(f"Strategy pinned to {p.spec.strategy.type}.")
    asked = p.spec.strategy.offload
    if asked != "none" and plan.offload == "none":
        lines.append(
            f"strategy.offload: {asked} is not run (offload none): {plan.strategy} on a CPU "
            "device keeps its states in the process's memory already, with nowhere else to "
            "move them."
        )
    if res.min_nodes is None and not (p.spec.strategy.type != "auto" and res.max_nodes):
        lines.append(f"{_OBJECTIVE_WORDS[objective]} ({result.evaluated} evaluated).")
    else:
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
    configurations = f"{result.evaluated} configuration" + ("" if result.evaluated == 1 else "s")
    # The GPU holds some configurations, only the host does not: say so first.
    host = result.least_host
    host = host if host is not None and host.host_need > p.host_budget else None
    if p.acc.cuda and host is not None:
        where = (
            f"{_gib(p.host_budget)} of host RAM per process (the {p.acc.name} GPU's "
            f"{_gib(limit)} with {MIN_HEADROOM:.0%} headroom would do)."
        )
    else:
        where = (
            f"{_gib(p.acc.memory_bytes)} per {_device(p)} with {MIN_HEADROOM:.0%} headroom "
            f"(limit {_gib(limit)})."
        )
    parts = [
        f"Nothing fits in {where} Tried world sizes {sizes} "
        f"({configurations}); the smallest need was {_gib(sm.device_need)} "
        f"at {_count(sm.cand.world_size, 'rank')} with {_config(sm)} (peak at {sm.est.peak_phase})."
    ]
    if host is not None or sm.host_need > p.host_budget:
        parts.append(_host_refusal(p, host or sm))
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
    ck = p.spec.checkpoint
    if ck.enabled and ck.async_:
        # What async saves cost (checkpoint_memory) may be all that does not fit: first the
        # device snapshot alone, then sync saves, which stage nothing (training then waits
        # for each save's write). Said only where it takes fewer GPUs than async saves need.
        lighter = _try(hint_problem, p, no_snapshot=True) if ck.device_snapshot else None
        sync = _try(hint_problem, p, sync_saves=True) if lighter is None else None
        field, ev = ("deviceSnapshot", lighter) if lighter else ("async", sync)
        if ev is not None and (more is None or ev.cand.world_size < more.cand.world_size):
            what = " (no staging copy)" if field == "async" else ""
            parts.append(
                f"checkpoint.{field}: false{what} would fit on "
                f"{_count(ev.cand.world_size, 'rank')} ({ev.cand.strategy}"
                + ("; training then waits for each save's write)." if field == "async" else ").")
            )
    if p.spec.method.type == "full":
        for method, label in (("lora", "LoRA"), ("qlora", "QLoRA")):
            ev = _try(hint_problem, p, method=method)
            if ev is not None:
                parts.append(f"{label} would fit on {ev.cand.world_size} x {p.acc.name}.")
    need = sm.device_need / (1 - MIN_HEADROOM)
    if sm.save.device_snapshot:
        parts.append(
            f"That includes the checkpoint's device snapshot ({_gib(sm.save.device_snapshot)}, "
            "checkpoint.deviceSnapshot)."
        )
    elif not p.acc.cuda and sm.save.host_peak:
        parts.append(f"That includes {_listed(_save_items(sm.save))} (checkpoint saves).")
    if not p.acc.cuda and sm.export_bytes:
        # On CPU it is a phase of the one budget (search.evaluate), after the last save.
        parts.append(f"It counts {_export_item(sm)} after training, beside the model states.")
    if p.acc.cuda:
        if sm.device_need > limit:
            parts.append(f"A GPU with >= {_gib(need)} would fit the smallest configuration.")
    else:
        per_pod = need * p.spec.resources.gpus_per_node
        runtime = runtime_host_bytes(p.spec.resources.gpus_per_node)
        parts.append(
            f"resources.memory >= {_gib_up(per_pod)} per pod ({_gib_up(need)} per process) would "
            f"fit the smallest configuration (with {MIN_HEADROOM:.0%} headroom; each process's "
            f"Python, torch and torchrun share counted as {_gib(runtime)})."
        )
    return " ".join(parts)


def _save_items(save: SaveMemory) -> list[str]:
    """The checkpoint save's memory, named as the refusals list it."""
    items = []
    if save.staging:
        items.append(f"the checkpoint's staging copy ({_gib(save.staging)})")
    if save.writing:
        items.append(f"a checkpoint write's copy ({_gib(save.writing)})")
    return items


def _listed(items: list[str]) -> str:
    return ", ".join(items[:-1]) + (" and " if len(items) > 1 else "") + items[-1]


def _export_item(sm: Evaluated) -> str:
    """Rank 0's export, and the share each process's budget counts (search.evaluate)."""
    share = f", {_gib(sm.export_share)} per process of its pod" if sm.export_ranks > 1 else ""
    return f"the export's gathered model ({_gib(sm.export_bytes)} on rank 0{share}; output.uri)"


def _host_refusal(p: Problem, sm: Evaluated) -> str:
    """What the configuration needing the least host RAM (of those the device holds) needs
    of it per process, and the per-pod resources.memory that would hold it."""
    what = [f"the runtime ({_gib(sm.runtime_host_bytes)})"] if sm.runtime_host_bytes else []
    if sm.est.host_bytes:
        what.append(f"offloaded states ({_gib(sm.est.host_bytes)})")
    # Phases one after another (Evaluated.host_need): the largest counts, not their sum.
    phases = [
        f"loading's reads of the weights ({_gib(sm.load_host_bytes)})"
        if sm.load_host_bytes
        else "",
        f"a resume's read group ({_gib(sm.resume_host_bytes)})" if sm.resume_host_bytes else "",
        " plus ".join(_save_items(sm.save)) if sm.save_host_bytes else "",
        _export_item(sm) if sm.cand.cuda and sm.export_bytes else "",
    ]
    phases = [phase for phase in phases if phase]
    if len(phases) > 1:
        largest = "the larger" if len(phases) == 2 else "the largest"
        what.append(f"{largest} of {_listed(phases)}")
    else:
        what.extend(phases)
    per_pod = sm.host_need * p.spec.resources.gpus_per_node
    return (
        f"Host RAM per process: {_listed(what)} need{'' if len(what) > 1 else 's'} "
        f"{_gib(sm.host_need)} at {_count(sm.cand.world_size, 'rank')} with {_config(sm)} "
        f"(budget {_gib(p.host_budget)}); resources.memory >= {_gib_up(per_pod)} per pod "
        "would hold it."
    )
