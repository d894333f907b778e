"""Wrap the model for the planned strategy: one short function per strategy.

Every strategy returns a `Parallel` with the same hooks the loop uses: `accumulate(last)`
around each micro-batch, `autocast` (whether the forward runs under torch.autocast),
`reduction_wait()` (time blocked in the gradient reduction, counted as wait) and how
`zero_grad` releases gradients.

Precision is what the planner (finetune_operator.planner.memory) assumes and its tracer runs:
- FSDP2 + bf16: fp32 sharded master parameters, `MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)` on every unit (layers and root), so the all-gathers move bf16 and the
  forward needs no autocast (the policy casts);
- DDP + bf16: an fp32 model (LoRA: frozen bf16 base, fp32 adapters) under torch.autocast;
- fp16: the same with float16 in place of bf16, plus dynamic loss scaling in the loop
  (finetune_trainer.loss_scale);
- fp32: no casting anywhere.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel

from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import Precision
from finetune_operator.api.spec_types import Offload
from finetune_operator.api.strategies import STRATEGIES, Strategy, StrategyTable
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.model import decoder_layers
from finetune_trainer.reduction_clock import ReductionClock
from finetune_trainer.state import TrainState

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket

BUCKET_BYTES = 25 * 2**20


@dataclass
class Parallel:
    model: nn.Module
    strategy: str
    accumulate: Callable[[bool], contextlib.AbstractContextManager[None]] = field(
        default=lambda last: contextlib.nullcontext()
    )
    # Seconds of the last step spent waiting for the gradient reduction after this rank's own
    # work was done (DDP's overlapped all-reduce); read after the device is synchronised.
    reduction_wait: Callable[[], float] = field(default=lambda: 0.0)
    # The forward runs under torch.autocast (DDP mixed precision); FSDP2 casts itself.
    autocast: bool = False
    # zero_grad(set_to_none=...): False where the gradients are persistent buffers (DDP's
    # gradient buckets); True frees them (FSDP's sharded gradients).
    zero_grad_set_to_none: bool = True
    # Hooks of backends that own more of the step (DeepSpeed: deepspeed_engine.py). The
    # defaults are the torch path's: the loop's own backward, clip + step + zero_grad.
    # Called with the trainer's optimizer once it exists (DeepSpeed builds its engine here
    # and replaces `model` with it).
    attach_optimizer: Callable[[torch.optim.Optimizer], None] = field(default=lambda opt: None)
    backward: Callable[[torch.Tensor], None] = field(default=lambda loss: loss.backward())
    # None: the loop clips, steps and zeroes the optimizer itself.
    optimizer_step: Callable[[], None] | None = None
    # What a checkpoint holds of this model and optimizer (state.TrainState's contract).
    state_type: type[TrainState] = TrainState
    # Export (export.py): the module to export and how to gather its full state dict; None:
    # `model` itself and export.gather_full_state_dict.
    export_module: Callable[[], nn.Module] | None = None
    gather_full_state_dict: Callable[[], dict[str, torch.Tensor]] | None = None


def _no_buffer_sync_in_forward() -> dict[str, bool]:
    """No collective hidden in forward. Recent torch releases have `forward_sync_buffers` for
    exactly that; older ones (2.11, the GPU machine's) lack it and raise a TypeError, and there
    `broadcast_buffers=False` stops the same per-forward sync (module states are still
    broadcast once at construction either way)."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def apply_ddp(model: nn.Module, device: torch.device, precision: Precision) -> Parallel:
    # DDP as designed: each gradient bucket is all-reduced as soon as backward fills it,
    # overlapped with the rest of backward. The straggler signal (compute vs wait) survives
    # the overlap: a comm hook marks the moment this rank hands over its last bucket (its own
    # work is done), and the end of backward marks when every reduction has arrived; the
    # time between is waiting (ReductionClock), added to the step's wait, not its compute.
    # bench/ddp_overlap.py measures this against plain DDP and the former design (reduce
    # after the sync point, no overlap).
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        **_no_buffer_sync_in_forward(),
        bucket_cap_mb=BUCKET_BYTES / 2**20,
        # Grads live in the reducer's buckets (allocated once): no second gradient-sized
        # block, which is what the planner counts (memory.DDP_BUCKET_BYTES).
        gradient_as_bucket_view=True,
    )
    clock = ReductionClock(device)

    def hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        clock.bucket_ready()
        return default_hooks.allreduce_hook(state, bucket)

    # Through a function: DDP checks the hook's annotations against the classes, and this
    # module's postponed (string) annotations would fail that check.
    ddp.register_comm_hook(None, lambda state, bucket: hook(state, bucket))

    @contextlib.contextmanager
    def accumulate(last: bool) -> Iterator[None]:
        if not last:
            with ddp.no_sync():
                yield
            return
        clock.start()
        yield
        clock.backward_done()

    return Parallel(
        model=ddp,
        strategy="ddp",
        accumulate=accumulate,
        reduction_wait=clock.wait_seconds,
        autocast=precision in ("bf16", "fp16"),
        # set_to_none would drop the views: the next backward would allocate fresh grads
        # beside the buckets (the extra block) until the reducer copies them back in.
        zero_grad_set_to_none=False,
    )


def _fsdp_accumulate(root: FSDPModule) -> Callable[[bool], contextlib.AbstractContextManager[None]]:
    @contextlib.contextmanager
    def accumulate(last: bool) -> Iterator[None]:
        # Reduce-scatter only on the last micro-batch; earlier ones accumulate unsharded grads.
        root.set_requires_gradient_sync(last)
        yield

    return accumulate


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool,
    offload: OffloadPolicy,
    mp_policy: MixedPrecisionPolicy,
    strategy: str,
) -> Parallel:
    # Shard each decoder layer first, then the root: each layer becomes its own all-gather
    # unit (only one layer's full weights live at a time), and the root picks up what is
    # left (embeddings, final norm, LM head) as one more unit.
    if any(type(p).__name__ == "Params4bit" for p in model.parameters()):
        # fully_shard turns every parameter into a plain DTensor Parameter: bitsandbytes'
        # packed uint8 4-bit weights lose their quant_state (or fail to become parameters).
        raise UnsupportedConfigError(
            f"method.type qlora with strategy.type {strategy} is not implemented: FSDP2 cannot "
            "shard bitsandbytes 4-bit weights; use strategy.type ddp or method.type lora"
        )
    layers = decoder_layers(model)
    if not layers:
        raise UnsupportedConfigError(
            f"strategy {strategy}: found no decoder layers to shard in {type(model).__name__}"
        )
    for layer in layers:
        fully_shard(
            layer,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            offload_policy=offload,
            mp_policy=mp_policy,
        )
    # The root's parameters are needed again right at the start of backward (LM head):
    # resharding them after forward would only re-gather them immediately.
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=False,
        offload_policy=offload,
        mp_policy=mp_policy,
    )
    assert isinstance(model, FSDPModule)
    return Parallel(model=model, strategy=strategy, accumulate=_fsdp_accumulate(model))


def offload_policy(offload: Offload, device: torch.device) -> OffloadPolicy:
    """FSDP2's policy for the plan's `offload`. A plan offloads to cpu only from a GPU; the
    device is checked again (a plan made for a GPU run on a CPU: nothing to move to)."""
    if offload == "nvme":
        raise UnsupportedConfigError("strategy.offload 'nvme' is not implemented yet")
    if offload == "cpu" and device.type == "cuda":
        return CPUOffloadPolicy()
    return OffloadPolicy()  # no offload (and nothing to offload to on a CPU run)


def check_precision(precision: str) -> None:
    if precision not in ("bf16", "fp16", "fp32"):
        raise UnsupportedConfigError(
            f"training.precision {precision} is not implemented; use bf16, fp16 or fp32"
        )


def fsdp_mp_policy(precision: Precision) -> MixedPrecisionPolicy:
    """bf16/fp16: gather half-precision copies of the fp32 sharded masters, reduce-scatter
    grads in fp32 (fp16's loss-scaled grads would overflow a half-precision sum first)."""
    check_precision(precision)
    if precision in ("bf16", "fp16"):
        half = torch.bfloat16 if precision == "bf16" else torch.float16
        return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()  # fp32 everywhere: no casting


def compile_blocks(model: nn.Module) -> int:
    """torch.compile each decoder block's forward (TorchTitan's per-block compile): one
    compiled graph shared by all blocks (same code, parameters as inputs), fused pointwise ops
    (RMSNorm, SwiGLU, rotary, residual adds) instead of one kernel each. Only the forward is
    compiled, so the wrappers' hooks (FSDP2's all-gather/reshard, activation checkpointing,
    DDP's gradient hooks) stay in eager around it. A block that fails to compile runs eager
    (suppress_errors). Returns the number of blocks compiled."""
    import torch._dynamo

    layers = decoder_layers(model)
    torch._dynamo.config.suppress_errors = True
    # One cache entry per distinct guard set; blocks share one, but leave room for the
    # train/no-grad variants and a few shapes before dynamo gives up and runs eager.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in layers:
        layer.forward = torch.compile(layer.forward)  # type: ignore[method-assign]
    return len(layers)


def torch_row(plan: Plan, strategies: StrategyTable = STRATEGIES) -> Strategy:
    """The plan's row of the strategy table, refused unless the torch backend runs it."""
    row = strategies.resolve(plan.strategy, plan.backend)
    if not row.implemented or row.backend != "fsdp":
        raise UnsupportedConfigError(
            f"strategy {plan.strategy} with backend {row.backend} is not implemented by the "
            "torch backend; use strategy.type ddp, zero3 (backend fsdp) or fsdp-*"
        )
    return strategies.effective(row)


def _mesh(row: Strategy, device: torch.device, local_world_size: int) -> DeviceMesh:
    world = dist.get_world_size()
    if not row.shard_within_node:
        return init_device_mesh(device.type, (world,))
    # Replicate across nodes, shard within a node: (nodes, gpus per node).
    if world % local_world_size:
        raise UnsupportedConfigError(
            f"{row.name} needs whole nodes: world {world}, {local_world_size} per node"
        )
    return init_device_mesh(
        device.type,
        (world // local_world_size, local_world_size),
        mesh_dim_names=("replicate", "shard"),
    )


def parallelize(
    model: nn.Module,
    plan: Plan,
    device: torch.device,
    local_world_size: int,
    *,
    precision: Precision,
    compile_model: bool = False,
) -> Parallel:
    """Wrap `model` as the plan's row of the strategy table says (replicated: DDP; sharded:
    FSDP2 with the row's resharding and mesh), in `precision` (training.precision). Rows the
    torch backend does not run are refused, never replaced (DeepSpeed plans never get
    here: loading.load_parallel_model hands them to deepspeed_engine). `compile_model`: compile the
    decoder blocks first (the trainer asks for it on CUDA only: on CPU/gloo the compile time
    would dwarf the few steps a test runs)."""
    check_precision(precision)
    row = torch_row(plan)
    if compile_model:
        compile_blocks(model)
    # The plan's offload, not the spec's: the planner says what runs (none for FSDP2 on a CPU
    # device, where strategy.offload: cpu has nowhere to move states; planner Candidate.offloads).
    if plan.offload != "none" and not row.offloadable:
        raise UnsupportedConfigError(f"strategy.offload: {plan.strategy} cannot offload")
    if row.replicated:
        return apply_ddp(model, device, precision)
    return apply_fsdp(
        model,
        _mesh(row, device, local_world_size),
        reshard_after_forward=row.reshard_after_forward,
        offload=offload_policy(plan.offload, device),
        mp_policy=fsdp_mp_policy(precision),
        strategy=plan.strategy,
    )
