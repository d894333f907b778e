"""What a trace reports: per-rank bytes by category, and the side-by-side with a plan.

No torch here (see planner/trace.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from finetune_operator.planner.trace_model import TraceConfig

if TYPE_CHECKING:
    from finetune_operator.api.plan import Plan

MIB = 2**20


@dataclass(frozen=True)
class TraceResult:
    """Bytes per rank, as the tracker counted them during one steady-state step."""

    config: TraceConfig
    peak: int  # max tensor memory over forward, backward and optimizer step
    peak_fwd_bwd: int  # max over forward + backward only
    peak_phase: Literal["forward/backward", "optimizer"]
    parameters: int  # resident parameters (the rank's shard)
    gradients: int  # resident gradients after backward (the rank's shard)
    optimizer: int  # AdamW states after the step (no temporaries)
    activations: int  # tensors created in forward (and AC recompute), alive at the peak
    buffers: int  # everything else alive at the peak: temporaries, gathers, buckets
    at_peak: dict[str, int]  # the tracker's own categories at the peak, as it names them
    seconds: float  # wall time of building + tracing
    notes: tuple[str, ...] = field(default=())

    def summary(self) -> str:
        c = self.config
        head = (
            f"{c.arch.model_type} L{c.arch.num_hidden_layers} H{c.arch.hidden_size} {c.method} "
            f"{c.strategy} N={c.world_size} b={c.micro_batch_size} s={c.seq_len} "
            f"ac={'on' if c.checkpointing else 'off'} {c.precision}"
        )
        cats = " ".join(f"{k}={v / MIB:.1f}" for k, v in self.at_peak.items() if v)
        return (
            f"{head}: peak {self.peak / MIB:.1f} MiB ({self.peak_phase}) "
            f"in {self.seconds:.1f}s [{cats}]"
        )


def _sum(snap: dict[str, int], *names: str) -> int:
    return sum(snap.get(n, 0) for n in names)


def ddp_bucket_bytes(config: TraceConfig, grads: int) -> int:
    """DDP's reducer cannot run on fake tensors: without gradient_as_bucket_view its buckets are
    one more gradient-sized block, allocated at construction and never freed."""
    if config.strategy != "ddp" or config.ddp_bucket_view:
        return 0
    return grads


def build_result(
    config: TraceConfig,
    notes: list[str],
    seconds: float,
    peak_snap: dict[str, int],
    peak_fb: dict[str, int],
    after_bwd: dict[str, int],
    after_step: dict[str, int],
) -> TraceResult:
    """The tracker's snapshots (categories as it names them) as per-category bytes."""
    params = _sum(after_step, "PARAM", "SHARDED_PARAM")
    grads = _sum(after_bwd, "GRAD", "SHARDED_GRAD")
    opt_states = _sum(after_step, "OPT")
    buckets = ddp_bucket_bytes(config, grads)
    if buckets:
        notes.append(f"DDP gradient buckets added analytically: {buckets / MIB:.1f} MiB")
    total = peak_snap.get("Total", 0)
    total_fb = peak_fb.get("Total", 0)
    acts = _sum(peak_snap, "ACT")
    at_peak = {k: v for k, v in peak_snap.items() if k != "Total"}
    grads_at_peak = _sum(peak_snap, "GRAD", "SHARDED_GRAD")
    # During the step the tracker files temporaries as OPT too: only the states are resident.
    opt_at_peak = min(_sum(peak_snap, "OPT"), opt_states)
    resident = _sum(peak_snap, "PARAM", "SHARDED_PARAM") + grads_at_peak + opt_at_peak
    return TraceResult(
        config=config,
        peak=total + buckets,
        peak_fwd_bwd=total_fb + buckets,
        peak_phase="optimizer" if total > total_fb else "forward/backward",
        parameters=params,
        gradients=grads,
        optimizer=opt_states,
        activations=acts,
        buffers=max(0, total - resident - acts) + buckets,
        at_peak=at_peak,
        seconds=seconds,
        notes=tuple(notes),
    )


def format_trace_comparison(plan: Plan, trace: TraceResult) -> str:
    """The planner's per-GPU estimate beside the traced figures, one row per category."""
    est = plan.memory
    rows = [
        ("parameters", est.parameters, trace.parameters),
        ("gradients", est.gradients, trace.gradients),
        ("optimizer", est.optimizer, trace.optimizer),
        ("activations", est.activations, trace.activations),
        ("buffers", est.buffers, trace.buffers),
        ("peak", est.peak, trace.peak),
    ]
    per = "MiB per GPU" if plan.device == "gpu" else "MiB per proc"  # a CPU job has no GPU
    lines = [f"{per:<14}{'estimate':>12}{'traced':>12}{'error':>9}"]
    for name, e, t in rows:
        err = f"{(e - t) / t * 100:+.1f}%" if t else "-"
        lines.append(f"{name:<14}{e / MIB:>12.1f}{t / MIB:>12.1f}{err:>9}")
    lines.append(
        f"traced peak in {trace.peak_phase}, {trace.seconds:.1f}s "
        "(activations/buffers: the tracer's split at its peak, not the planner's)"
    )
    lines.extend(f"note: {n}" for n in trace.notes)
    return "\n".join(lines)
