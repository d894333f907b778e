"""Memory tracer: one real training step under ``FakeTensorMode``, measured by PyTorch's own
``MemTracker`` / ``FSDPMemTracker`` (DESIGN.md §4, accuracy contract).

The Hugging Face architecture is built on the meta device, wrapped as the strategy says (plain
module for DDP, FSDP2 ``fully_shard`` per decoder layer + root for FSDP/ZeRO-3) over a fake process
group of the planned world size, and materialised as fake tensors: no memory is allocated, so
7B-class shapes trace on a laptop. torch is imported inside functions only: the operator image has
no torch, and importing this module must stay free.

Where a CPU trace would not show what a GPU does, the tracer makes the GPU choice explicitly:
- attention runs under ``sdpa_kernel(FLASH_ATTENTION)``: the CPU flash kernel, like the GPU one,
  returns only the output and log-sum-exp (no s² scores); a model that cannot use it (eager
  attention, soft-capping) falls back and says so in ``notes``;
- dropout runs as ``native_dropout`` (CUDA's fused kernel: the saved mask is 1-byte bool); on
  CPU ``F.dropout`` multiplies by a noise tensor of the input's dtype and saves that (2-4 bytes
  per element), an artefact of the CPU path;
- AdamW runs ``foreach=True`` (the CUDA default; CPU defaults to the per-tensor loop, whose
  temporaries are one parameter wide instead of one whole shard wide);
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
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from finetune_operator.api.spec import LoraSpec, ModelArchitecture

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from finetune_operator.api.plan import Plan
    from finetune_operator.api.spec import FineTuneJobSpec

TraceStrategy = Literal["ddp", "fsdp-full-shard", "zero3", "fsdp-shard-grad-op"]
# bf16-mixed: fp32 master params, bf16 compute (FSDP MixedPrecisionPolicy, DDP autocast);
# bf16-pure: params, grads and AdamW states all bf16; fp32: everything fp32.
TracePrecision = Literal["bf16-mixed", "bf16-pure", "fp32"]

_SHARDED: frozenset[str] = frozenset({"fsdp-full-shard", "zero3", "fsdp-shard-grad-op"})
_MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    """One configuration to trace; every field is a knob of the real step."""

    arch: ModelArchitecture
    method: Literal["full", "lora"] = "full"
    lora: LoraSpec | None = None
    strategy: TraceStrategy = "ddp"
    world_size: int = 1
    micro_batch: int = 1
    seq_len: int = 2048
    checkpointing: bool = False
    precision: TracePrecision = "bf16-mixed"
    ddp_bucket_view: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in ("ddp", *_SHARDED):
            raise ValueError(f"strategy {self.strategy!r} cannot be traced (ddp or fsdp/zero3)")
        if (
            self.arch.num_local_experts
            and self.strategy == "ddp"
            and self.precision == "bf16-mixed"
        ):
            # grouped_mm wants bf16 operands and CPU autocast does not cast them.
            raise ValueError("MoE with DDP bf16-mixed cannot be traced on CPU; use bf16-pure")
        if self.world_size < 1 or self.micro_batch < 1 or self.seq_len < 1:
            raise ValueError("world_size, micro_batch and seq_len must be >= 1")


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
            f"{c.strategy} N={c.world_size} b={c.micro_batch} s={c.seq_len} "
            f"ac={'on' if c.checkpointing else 'off'} {c.precision}"
        )
        cats = " ".join(f"{k}={v / _MIB:.1f}" for k, v in self.at_peak.items() if v)
        return (
            f"{head}: peak {self.peak / _MIB:.1f} MiB ({self.peak_phase}) "
            f"in {self.seconds:.1f}s [{cats}]"
        )


def trace_memory(arch: ModelArchitecture, **options: Any) -> TraceResult:
    """Trace one training step of ``arch``; options are the fields of :class:`TraceConfig`."""
    return run_trace(TraceConfig(arch=arch, **options))


def run_trace(config: TraceConfig) -> TraceResult:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("trace needs its own fake process group: a process group is active")
    start = time.perf_counter()
    old_dtype, old_hook = torch.get_default_dtype(), sys.excepthook
    try:
        return _trace(config, start)
    finally:
        torch.set_default_dtype(old_dtype)
        sys.excepthook = old_hook  # init_process_group wraps it with a rank prefix each time
        if dist.is_initialized():
            dist.destroy_process_group()


def _hf_config(arch: ModelArchitecture) -> Any:
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {
        "hidden_size": arch.hidden_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads or arch.num_attention_heads,
        "intermediate_size": arch.intermediate_size,
        "vocab_size": arch.vocab_size,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "use_cache": False,
    }
    if arch.head_dim is not None:
        kwargs["head_dim"] = arch.head_dim
    if arch.max_position_embeddings is not None:
        kwargs["max_position_embeddings"] = arch.max_position_embeddings
    if arch.num_local_experts is not None:
        # Mixtral calls them local experts, Qwen-MoE just experts.
        key = "num_local_experts" if arch.model_type == "mixtral" else "num_experts"
        kwargs[key] = arch.num_local_experts
        kwargs["num_experts_per_tok"] = arch.num_experts_per_tok
    if arch.moe_intermediate_size is not None:
        kwargs["moe_intermediate_size"] = arch.moe_intermediate_size
    return AutoConfig.for_model(arch.model_type, **kwargs)


def _build_model(config: TraceConfig, notes: list[str]) -> Any:
    """The model on the meta device, with adapters and checkpointing, not yet wrapped."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = _hf_config(config.arch)
    auto: Any = AutoModelForCausalLM  # untyped classmethods
    extra: dict[str, Any] = {"attn_implementation": "sdpa"}
    if config.arch.num_local_experts is not None:
        # The data-dependent eager expert loop cannot run on fake tensors; grouped_mm is the
        # GPU path anyway.
        extra["experts_implementation"] = "grouped_mm"
    with torch.device("meta"):
        try:
            model = auto.from_config(hf, **extra)
        except ValueError as err:  # e.g. soft-capped attention refuses sdpa
            notes.append(f"sdpa refused ({err}); eager attention materialises s² scores")
            extra["attn_implementation"] = "eager"
            model = auto.from_config(hf, **extra)
    if config.checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if config.method == "lora":
        from peft import LoraConfig, get_peft_model

        spec = config.lora or LoraSpec()
        lcfg = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            lora_dropout=spec.dropout,
            target_modules=list(spec.target_modules),
        )
        # peft keeps adapters in fp32 over a bf16 base (autocast_adapter_dtype), as on a GPU.
        model = get_peft_model(model, lcfg)
    model.train()
    return model


def _decoder_layers(model: Any) -> list[Any]:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(inner.model.layers)


def _wrap(config: TraceConfig, model: Any, notes: list[str]) -> Any:
    """Shard with FSDP2 for the sharded strategies; the order (layers, then root) is FSDP2's."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if config.strategy not in _SHARDED:
        return model
    mesh = init_device_mesh("cpu", (config.world_size,))
    reshard = config.strategy != "fsdp-shard-grad-op"
    mp = None
    if config.precision == "bf16-mixed":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    # The root (embeddings, norm, head) is never resharded after forward, as the trainer does
    # (finetune_trainer.parallelize): backward re-gathers it at once.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    notes.append(f"FSDP2 per decoder layer (reshard_after_forward={reshard}) + root (False)")
    return model


def _step_contexts(config: TraceConfig, notes: list[str]) -> list[AbstractContextManager[Any]]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ctxs: list[AbstractContextManager[Any]] = [
        sdpa_kernel([SDPBackend.FLASH_ATTENTION]),
    ]
    if config.strategy == "ddp" and config.precision == "bf16-mixed":
        notes.append("DDP bf16-mixed uses CPU autocast: its op lists differ from CUDA's")
        ctxs.append(torch.autocast("cpu", dtype=torch.bfloat16))
    return ctxs


def _fused_dropout() -> AbstractContextManager[Any]:
    """``F.dropout`` as CUDA runs it: aten::dropout takes the fused ``native_dropout`` (bool
    mask) on CUDA (ATen Dropout.cpp ``is_fused_kernel_acceptable``), the unfused
    ``input * noise`` with a noise tensor of the input dtype on CPU."""
    from unittest import mock

    import torch
    import torch.nn.functional as F

    def dropout(x: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if not training or p == 0.0:
            return x
        return torch.native_dropout(x, p, training)[0]

    return mock.patch.object(F, "dropout", dropout)


def _fast(tracker_cls: type[Any]) -> type[Any]:
    """The tracker without its per-module peak snapshots: torch 2.13 deep-copies a snapshot
    into every active module on each new peak, O(modules) per op (60 s for a LoRA'd 0.5B model
    instead of 10). Only the global peak is kept, exactly as the tracker computes it."""

    class Fast(tracker_cls):  # type: ignore[misc]
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

    return Fast


class _NoHook:
    def remove(self) -> None:
        return None


def _skip_frozen_grad_hooks(tracker: Any, model: Any) -> None:
    """MemTracker hooks the gradient of every parameter it meets and fails on frozen ones (LoRA's
    base weights). Marking them as already hooked is the only way around it in torch 2.13; the
    handles it would later remove are no-ops."""
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())


def _snap(tracker: Any, kind: str) -> dict[str, int]:
    merged: dict[str, int] = {}
    for dev_snap in tracker.get_tracker_snapshot(kind).values():
        for key, val in dev_snap.items():
            name = key.name if hasattr(key, "name") else str(key)
            merged[name] = merged.get(name, 0) + int(val)
    return merged


def _sum(snap: dict[str, int], *names: str) -> int:
    return sum(snap.get(n, 0) for n in names)


def _trace(config: TraceConfig, start: float) -> TraceResult:
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    notes: list[str] = []
    sharded = config.strategy in _SHARDED
    full = config.method == "full"
    master = torch.float32 if config.precision != "bf16-pure" and full else torch.bfloat16
    torch.set_default_dtype(torch.float32 if config.precision == "fp32" else master)
    if sharded:
        # The mesh must exist before FakeTensorMode is entered (TOOLING.md).
        dist.init_process_group("fake", rank=0, world_size=config.world_size, store=FakeStore())
    model = _wrap(config, _build_model(config, notes), notes)
    vocab = config.arch.vocab_size
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        if config.arch.tie_word_embeddings and not sharded:
            # to_empty gives each module its own tensor; FSDP had already merged the shared one.
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            base.tie_weights()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        for p in params:  # warm-up: create the AdamW states outside the tracker
            p.grad = torch.zeros_like(p)
        opt.step()
        # DDP with gradient_as_bucket_view: the gradients *are* the reducer's buckets, allocated
        # once and never freed, so they stay; everywhere else zero_grad frees them.
        keep_grads = config.strategy == "ddp" and config.ddp_bucket_view
        opt.zero_grad(set_to_none=not keep_grads)
        ids = torch.randint(0, vocab, (config.micro_batch, config.seq_len))
        tracker = _fast(FSDPMemTracker)(model, opt) if sharded else _fast(MemTracker)()
        if not sharded:
            _skip_frozen_grad_hooks(tracker, model)
            tracker.track_external(model, opt)
        # Dropout stays fused through backward: checkpointing recomputes it there.
        with tracker, _fused_dropout(), ExitStack() as stack:
            for ctx in _step_contexts(config, notes):
                stack.enter_context(ctx)
            # `.loss` only, as a trainer holds it: the bf16 logits die after the fp32 upcast.
            loss = model(input_ids=ids, labels=ids).loss
            stack.close()
            loss.backward()
            del loss
            after_bwd = _snap(tracker, "current")
            peak_fb = _snap(tracker, "peak")
            opt.step()
            after_step = _snap(tracker, "current")
            opt.zero_grad(set_to_none=not keep_grads)
        peak_snap = _snap(tracker, "peak")
    # AdamW's `step` counters are 4-byte tensors that a GPU keeps on the host (not capturable).
    host = 4 * len(params)
    for snap in (peak_snap, peak_fb, after_step):
        snap["OPT"] = snap.get("OPT", 0) - host
        snap["Total"] = snap.get("Total", 0) - host
    return _result(config, notes, start, peak_snap, peak_fb, after_bwd, after_step)


def _ddp_bucket_bytes(config: TraceConfig, grads: int) -> int:
    if config.strategy != "ddp" or config.ddp_bucket_view:
        return 0
    return grads


def _result(
    config: TraceConfig,
    notes: list[str],
    start: float,
    peak_snap: dict[str, int],
    peak_fb: dict[str, int],
    after_bwd: dict[str, int],
    after_step: dict[str, int],
) -> TraceResult:
    params = _sum(after_step, "PARAM", "SHARDED_PARAM")
    grads = _sum(after_bwd, "GRAD", "SHARDED_GRAD")
    opt_states = _sum(after_step, "OPT")
    buckets = _ddp_bucket_bytes(config, grads)
    if buckets:
        notes.append(f"DDP gradient buckets added analytically: {buckets / _MIB:.1f} MiB")
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
        seconds=time.perf_counter() - start,
        notes=tuple(notes),
    )


def trace_plan(spec: FineTuneJobSpec, plan: Plan) -> TraceResult:
    """Trace the job's real architecture at the plan's strategy, world size, micro-batch and
    checkpointing (``ftjob plan --trace``)."""
    from finetune_operator.planner.architecture import resolve_model

    if spec.method.type == "qlora":
        raise ValueError("qlora cannot be traced: 4-bit bitsandbytes weights need a GPU")
    strategy: str = plan.strategy
    world = plan.world_size
    if strategy == "fsdp-hybrid":
        # HSDP shards within a node and replicates across: per-rank memory is full-shard's at
        # the node's size.
        strategy, world = "fsdp-full-shard", plan.gpus_per_node
    if strategy not in ("ddp", *_SHARDED):
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
            micro_batch=plan.micro_batch_size,
            seq_len=spec.training.sequence_length,
            checkpointing=plan.activation_checkpointing,
            precision=precision,
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
    lines = [f"{'MiB per GPU':<14}{'estimate':>12}{'traced':>12}{'error':>9}"]
    for name, e, t in rows:
        err = f"{(e - t) / t * 100:+.1f}%" if t else "-"
        lines.append(f"{name:<14}{e / _MIB:>12.1f}{t / _MIB:>12.1f}{err:>9}")
    lines.append(
        f"traced peak in {trace.peak_phase}, {trace.seconds:.1f}s "
        "(activations/buffers: the tracer's split at its peak, not the planner's)"
    )
    lines.extend(f"note: {n}" for n in trace.notes)
    return "\n".join(lines)
