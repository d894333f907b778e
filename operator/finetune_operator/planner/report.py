"""`ftjob plan job.yaml` output: a plain, aligned text table of a Plan (bytes in GiB, or in
MiB for a plan under 1 GiB, whose rows would all read 0.00 GiB)."""

from __future__ import annotations

import textwrap

from finetune_operator.api.plan import Plan

GIB = 1024**3
MIB = 1024**2
_MEMORY_ROWS = (
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "buffers",
    "peak",
    "reserved",
    "total",
)


# What a CPU process's one memory holds beside the step's breakdown (planner/search.py).
_BESIDE_THE_STEP = "a checkpoint save's copies, a resume's read or offloaded states"


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _configurations(n: int) -> str:
    return _count(n, "configuration")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.2f} MiB"


def _unit(plan: Plan) -> tuple[str, int]:
    """The breakdown's unit: MiB where the whole need is under 1 GiB (a CPU toy's 6 MiB)."""
    return ("GiB", GIB) if plan.memory.total >= GIB else ("MiB", MIB)


def _hours(h: float) -> str:
    # Two significant digits below an hour: a short job's 0.004 h must not print as 0.0.
    return f"{h:,.1f}" if h >= 1 or h == 0 else f"{h:.2g}"


def _compute(plan: Plan) -> tuple[str, str]:
    """The cost row: GPU-hours, or for a CPU job (no GPU at all) its process-hours."""
    if plan.device == "gpu":
        return ("GPU-hours", _hours(plan.gpu_hours))
    return ("GPU-hours", f"none (CPU job: {_hours(plan.gpu_hours)} process-hours)")


def render_plan(plan: Plan, width: int = 88) -> str:
    """Key facts, the per-GPU memory breakdown, then the reason wrapped to `width`."""
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    per = "Memory per GPU" if plan.device == "gpu" else "Memory per process"
    ga = plan.gradient_accumulation_steps
    # The need the headroom is of: on a CPU job, with the states DeepSpeed offloads to its
    # host buffers (the same RAM), a resume's read group or a checkpoint save's copies, which
    # the breakdown leaves out. (Past the headroom's rounding only: a plan without any shows
    # its total as before.)
    need = plan.memory.total
    with_host = round(plan.gpu_memory_bytes * (1 - plan.headroom))
    if plan.device != "gpu" and with_host - need > plan.gpu_memory_bytes * 1e-4:
        need = with_host
    facts = [
        ("Verdict", verdict),
        ("World size", f"{plan.world_size} ({_count(plan.nodes, 'node')} x {plan.gpus_per_node})"),
        ("Objective", plan.objective if plan.objective != "fixed" else "none (world size fixed)"),
        ("Strategy", f"{plan.strategy}, backend {plan.backend}, offload {plan.offload}"),
        ("Micro-batch", f"{plan.micro_batch_size} x {ga} accumulation steps"),
        ("Activation checkpointing", "full" if plan.activation_checkpointing else "none"),
        (
            per,
            f"{_gib(need)} of {_gib(plan.gpu_memory_bytes)} ({plan.headroom:.1%} headroom)",
        ),
        ("Step time", f"{plan.estimated_step_seconds:.3f} s (modelled)"),
        ("Throughput", f"{plan.tokens_per_second:,.0f} tokens/s"),
        _compute(plan),
        ("Evaluated", _configurations(plan.candidates_evaluated)),
    ]
    key_w = max(len(k) for k, _ in facts)
    lines = [f"{k:<{key_w}}  {v}" for k, v in facts]
    lines.append("")
    unit, scale = _unit(plan)
    lines.append(f"{per:<18}{unit:>6}")
    for name in _MEMORY_ROWS:
        value = getattr(plan.memory, name)
        if name == "total":
            # What the total adds to the allocator's reserve, named: 608 MiB appearing from
            # nowhere between "reserved 6.40" and "total 614.40" read as an error.
            extra = plan.memory.total - plan.memory.reserved
            label = "cuda context" if plan.device == "gpu" else "runtime"
            lines.append(f"{label:<14}{extra / scale:>10.2f}")
        lines.append(f"{name:<14}{value / scale:>10.2f}")
    if need != plan.memory.total:
        # The header's figure, reconciled: the breakdown's total alone read as a contradiction
        # (614.40 MiB under "Memory per process 617.27 MiB").
        lines.append(f"{'needed':<14}{need / scale:>10.2f}")
        lines.append(f"  (total, and beside it {_BESIDE_THE_STEP})")
    lines.append("")
    lines.extend(textwrap.wrap("Reason: " + plan.reason, width=width))
    return "\n".join(lines)


# `ftjob plan` (cli.py) imports the table renderer under this name.
render_plan_table = render_plan
