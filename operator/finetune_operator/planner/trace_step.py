"""One steady-state training step under ``FakeTensorMode``, measured by ``MemTracker`` /
``FSDPMemTracker``, with the GPU's choices made explicit where the CPU would differ (the list
is in planner/trace.py).

torch and transformers are imported inside functions only (see planner/trace.py).
"""

from __future__ import annotations

import time
import warnings
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from finetune_operator.planner.trace_model import TraceConfig, base_model, build_model, wrap
from finetune_operator.planner.trace_result import TraceResult, build_result

if TYPE_CHECKING:
    from contextlib import AbstractContextManager


# ---- the GPU path, where a CPU/fake-tensor step would take another ----


def unpacked_positions() -> AbstractContextManager[Any]:
    """Sequences are not packed, as transformers finds on real tensors.

    ``masking_utils.find_packed_sequence_indices`` returns None for plain ``arange`` positions,
    so ``create_causal_mask`` skips the mask (``_ignore_causal_mask_sdpa``) and SDPA runs
    ``is_causal=True`` with ``enable_gqa`` (``use_gqa_in_sdpa``: mask is None), on CPU and CUDA
    alike. On a fake tensor it cannot read the values (``is_tracing`` is true for FakeTensor) and
    returns the packed-sequence ids, which disables the skip: a (b, 1, s, s) bool mask is built,
    cast per layer to an additive mask of the compute dtype (``aten.where``, b*s*s*e, saved by
    SDPA) and k/v are ``repeat_kv``'d to all heads. Seen with a TorchDispatchMode on a 2-layer
    Llama (transformers 5.23): real tensors call the CPU flash kernel with is_causal=True, no
    mask and the KV heads; fake tensors with a mask and all q heads. The tracer's positions are
    the model's default ``arange``, so "not packed" is the answer a real step gets. Without
    this, SmolLM-135M (30 layers) traced +5-6% (b=1, s=2048: +331 MiB).
    """
    from unittest import mock

    from transformers import masking_utils

    return mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda *a, **k: None)


def fused_dropout() -> AbstractContextManager[Any]:
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


def forward_contexts(config: TraceConfig, notes: list[str]) -> list[AbstractContextManager[Any]]:
    """Entered for the forward only (AC recompute in backward reuses its mask and kernel)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ctxs: list[AbstractContextManager[Any]] = [
        sdpa_kernel([SDPBackend.FLASH_ATTENTION]),
        unpacked_positions(),
    ]
    if config.strategy == "ddp" and config.precision == "bf16-mixed":
        notes.append("DDP bf16-mixed uses CPU autocast: its op lists differ from CUDA's")
        ctxs.append(torch.autocast("cpu", dtype=torch.bfloat16))
    return ctxs


# ---- the tracker ----


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


# ---- the step ----

_MOD_TRACKER_NAMES = "The module hierarchy tracking maybe be messed up"


def trace_step(config: TraceConfig, start: float) -> TraceResult:
    """Build, shard and materialise the model as fake tensors, then track one step."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    notes: list[str] = []
    sharded = config.sharded
    full = config.method == "full"
    master = torch.float32 if config.precision != "bf16-pure" and full else torch.bfloat16
    torch.set_default_dtype(torch.float32 if config.precision == "fp32" else master)
    if sharded:
        # The mesh must exist before FakeTensorMode is entered (TOOLING.md).
        dist.init_process_group("fake", rank=0, world_size=config.world_size, store=FakeStore())
    model = wrap(config, build_model(config, notes), notes)
    vocab = config.arch.vocab_size
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        if config.arch.tie_word_embeddings and not sharded:
            # to_empty gives each module its own tensor; FSDP had already merged the shared one.
            base_model(model).tie_weights()
        params = [p for p in model.parameters() if p.requires_grad]
        # fused: the trainer's AdamW on CUDA (finetune_trainer.optim.adamw_implementation).
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        for p in params:  # warm-up: create the AdamW states outside the tracker
            p.grad = torch.zeros_like(p)
        opt.step()
        # DDP with gradient_as_bucket_view: the gradients *are* the reducer's buckets, allocated
        # once and never freed, so they stay; everywhere else zero_grad frees them.
        keep_grads = config.strategy == "ddp" and config.ddp_bucket_view
        opt.zero_grad(set_to_none=not keep_grads)
        ids = torch.randint(0, vocab, (config.micro_batch_size, config.seq_len))
        tracker = _fast(FSDPMemTracker)(model, opt) if sharded else _fast(MemTracker)()
        if not sharded:
            _skip_frozen_grad_hooks(tracker, model)
            tracker.track_external(model, opt)
        # Dropout stays fused through backward: checkpointing recomputes it there.
        with tracker, fused_dropout(), ExitStack() as stack, warnings.catch_warnings():
            # ModTracker names modules by class: transformers' kernel hub wraps functions in
            # modules all named "Func", one entered inside another, and it warns "Please file
            # a bug to PyTorch" (once per LoRA layer). Only its per-module attribution is
            # affected; the peaks read here are the allocator's totals.
            warnings.filterwarnings("ignore", _MOD_TRACKER_NAMES, UserWarning)
            for ctx in forward_contexts(config, notes):
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
    return build_result(
        config, notes, time.perf_counter() - start, peak_snap, peak_fb, after_bwd, after_step
    )
