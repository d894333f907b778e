"""Memory tracer: one real training step under ``FakeTensorMode``, measured by PyTorch's own
``MemTracker`` / ``FSDPMemTracker`` (DESIGN.md §4, accuracy contract). The public entry point;
the work is split by responsibility:

  trace_model   TraceConfig, and the HF model built on the meta device, with adapters,
                checkpointing and FSDP2 sharding
  trace_step    the tracked step, and the GPU's choices made explicit (below)
  trace_result  TraceResult, and the side-by-side with a plan

The Hugging Face architecture is built on the meta device, wrapped as the strategy says (plain
module for DDP, FSDP2 ``fully_shard`` per decoder layer + root for FSDP/ZeRO-3) over a fake process
group of the planned world size, and materialised as fake tensors: no memory is allocated, so
7B-class shapes trace on a laptop. torch is imported inside functions only: the operator image has
no torch, and importing these modules must stay free.

Where a CPU or fake-tensor trace would not show what a GPU does, the tracer makes the GPU choice
explicitly:
- attention runs under ``sdpa_kernel(FLASH_ATTENTION)``: the CPU flash kernel, like the GPU one,
  returns only the output and log-sum-exp (no s² scores); a model that cannot use it (eager
  attention, soft-capping) falls back and says so in ``notes``;
- the causal mask is not materialised: with no padding, transformers passes ``is_causal=True``
  and no mask to SDPA (GQA through ``enable_gqa``, no ``repeat_kv``), but its packed-sequence
  check on ``position_ids`` reads values and so is skipped for fake tensors, which then forces a
  b*s*s bool mask, its per-layer cast and repeated k/v (``trace_step.unpacked_positions``);
- dropout runs as ``native_dropout`` (CUDA's fused kernel: the saved mask is 1-byte bool); on
  CPU ``F.dropout`` multiplies by a noise tensor of the input's dtype and saves that (2-4 bytes
  per element), an artefact of the CPU path;
- AdamW runs ``fused=True`` (what the trainer runs on CUDA: no state-sized temporaries; CPU
  defaults to the per-tensor loop);
- optimizer states are created by a warm-up step *outside* the tracker: step 1's lazy init is not
  the steady state, and under DTensor it is counted at unsharded size by the tracker;
- DDP's reducer cannot run on fake tensors; its buckets (one copy of the trainable gradients,
  allocated at construction, never freed) are modelled: with ``gradient_as_bucket_view`` the
  gradients are the buckets, so they are kept across ``zero_grad``; without it (torch's
  default) the buckets are one more gradient-sized block added to every figure of the step.
What stays out: CUDA context, cuBLAS/flash workspaces inside kernels, the caching allocator's
512-byte rounding and fragmentation (``reserved``); with DDP + bf16-mixed the CPU autocast op lists.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from finetune_operator.api.spec import ModelArchitecture
from finetune_operator.planner.trace_model import (
    SHARDED,
    TraceConfig,
    TracePrecision,
    TraceStrategy,
)
from finetune_operator.planner.trace_result import TraceResult, format_trace_comparison

if TYPE_CHECKING:
    from finetune_operator.api.plan import Plan
    from finetune_operator.api.spec import FineTuneJobSpec

__all__ = [
    "TraceConfig",
    "TracePrecision",
    "TraceResult",
    "TraceStrategy",
    "format_trace_comparison",
    "run_trace",
    "trace_memory",
    "trace_plan",
]


def trace_memory(arch: ModelArchitecture, **options: Any) -> TraceResult:
    """Trace one training step of ``arch``; options are the fields of :class:`TraceConfig`."""
    return run_trace(TraceConfig(arch=arch, **options))


def run_trace(config: TraceConfig) -> TraceResult:
    """Trace ``config`` in this process, restoring torch's default dtype and process group."""
    import torch
    import torch.distributed as dist

    from finetune_operator.planner.trace_step import trace_step

    if dist.is_initialized():
        raise RuntimeError("trace needs its own fake process group: a process group is active")
    start = time.perf_counter()
    old_dtype, old_hook = torch.get_default_dtype(), sys.excepthook
    try:
        return trace_step(config, start)
    finally:
        torch.set_default_dtype(old_dtype)
        sys.excepthook = old_hook  # init_process_group wraps it with a rank prefix each time
        if dist.is_initialized():
            dist.destroy_process_group()


def trace_plan(spec: FineTuneJobSpec, plan: Plan) -> TraceResult:
    """Trace the job's real architecture at the plan's strategy, micro-batch and checkpointing
    and the world size its memory was planned at (``ftjob plan --trace``)."""
    from finetune_operator.planner.architecture import resolve_model

    if spec.method.type == "qlora":
        raise ValueError("qlora cannot be traced: 4-bit bitsandbytes weights need a GPU")
    strategy: str = plan.strategy
    # The plan's memory is per rank at minNodes when the job is elastic (planner/planning.py:
    # sharded states grow when ranks leave): trace that world size, not the launched one, or
    # the two columns describe different jobs.
    min_nodes = spec.resources.min_nodes
    world = min_nodes * plan.gpus_per_node if min_nodes is not None else plan.world_size
    if strategy == "fsdp-hybrid":
        # HSDP shards within a node and replicates across: per-rank memory is full-shard's at
        # the node's size.
        strategy, world = "fsdp-full-shard", plan.gpus_per_node
    if strategy not in ("ddp", *SHARDED):
        raise ValueError(
            f"strategy {strategy} (DeepSpeed) cannot be traced; the tracer runs ddp, "
            "fsdp-full-shard/zero3 and fsdp-shard-grad-op"
        )
    precision: TracePrecision = "fp32" if spec.training.precision == "fp32" else "bf16-mixed"
    result = run_trace(
        TraceConfig(
            arch=resolve_model(spec.model).arch,
            method="lora" if spec.method.type == "lora" else "full",
            lora=spec.method.lora,
            strategy=strategy,  # type: ignore[arg-type]  # narrowed by the check above
            world_size=world,
            micro_batch_size=plan.micro_batch_size,
            seq_len=spec.training.sequence_length,
            checkpointing=plan.activation_checkpointing,
            precision=precision,
            # What the trainer runs (finetune_trainer/parallelize.py) and the planner models:
            # DDP's gradients are its buckets.
            ddp_bucket_view=True,
        )
    )
    caveats = list(result.notes)
    if plan.offload != "none":
        caveats.append(f"offload={plan.offload} is not traced: states counted on the GPU")
    if spec.training.optimizer != "adamw":
        caveats.append(f"optimizer {spec.training.optimizer} traced as AdamW")
    if spec.training.precision == "fp16":
        caveats.append("fp16 traced as bf16 (same sizes)")
    return TraceResult(**{**result.__dict__, "notes": tuple(caveats)})
