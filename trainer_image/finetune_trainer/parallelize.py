"""Wrap the model for the planned strategy: one short function per strategy.

Every strategy returns a `Parallel` with the same hooks the loop uses: `accumulate(last)`
around each micro-batch, `autocast` (whether the forward runs under torch.autocast),
`sync_gradients()` after the step's sync point and how `zero_grad` releases gradients.

Precision is what the planner (finetune_operator.planner.memory) assumes and its tracer runs:
- FSDP2 + bf16: fp32 sharded master parameters, `MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)` on every unit (layers and root), so the all-gathers move bf16 and the
  forward needs no autocast (the policy casts);
- DDP + bf16: an fp32 model (LoRA: frozen bf16 base, fp32 adapters) under torch.autocast;
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
from finetune_operator.api.spec import Precision, StrategySpec
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.model import decoder_layers

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
    sync_gradients: Callable[[], None] = field(default=lambda: None)
    # The forward runs under torch.autocast(bf16) (DDP mixed precision); FSDP2 casts itself.
    autocast: bool = False
    # zero_grad(set_to_none=...): False where the gradients are persistent buffers (DDP's
    # gradient buckets); True frees them (FSDP's sharded gradients).
    zero_grad_set_to_none: bool = True


class _BucketCapture:
    """A DDP communication hook that communicates nothing: it records each gradient bucket's
    flat buffer so that `all_reduce()` can average the buckets in place after the step's sync
    point. With `gradient_as_bucket_view=True` the parameters' `.grad` are views into these
    buffers, so no gradient is ever copied or concatenated."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.buffers: dict[int, torch.Tensor] = {}

    def hook(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        self.buffers[bucket.index()] = buffer
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut

    def all_reduce(self) -> None:
        if not self.buffers:
            raise RuntimeError("DDP produced no gradient buckets in this step's backward")
        for index in sorted(self.buffers):  # the same order on every rank
            flat = self.buffers[index]
            dist.all_reduce(flat)
            flat.div_(self.world)
        self.buffers.clear()


def apply_ddp(model: nn.Module, device: torch.device, precision: Precision) -> Parallel:
    # Gradients are reduced explicitly after the step's sync point instead of inside backward:
    # the loop then times this rank's compute without time spent waiting for slower peers,
    # which is what straggler detection reads. The cost is no overlap of the gradient
    # all-reduce with backward. The last micro-batch's backward still runs DDP's reducer (it
    # fills the buckets, the parameters' grads become views into them) but its comm hook
    # only records the buckets; `sync_gradients` all-reduces them in place.
    # No collective hidden in forward (`forward_sync_buffers` exists from torch 2.12 on;
    # before it, broadcast_buffers=False below already stops the forward's buffer broadcast).
    sync_buffers = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else {}
    )
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=False,
        **sync_buffers,
        bucket_cap_mb=BUCKET_BYTES / 2**20,
        # Grads live in the reducer's buckets (allocated once): no second gradient-sized
        # block, which is what the planner counts (memory.DDP_BUCKET_BYTES).
        gradient_as_bucket_view=True,
    )
    capture = _BucketCapture(dist.get_world_size())
    # Through a lambda: DDP checks the hook's annotations against the classes, and this
    # module's postponed (string) annotations would fail that check.
    ddp.register_comm_hook(None, lambda state, bucket: capture.hook(state, bucket))

    def accumulate(last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if last else ddp.no_sync()

    return Parallel(
        model=ddp,
        strategy="ddp",
        accumulate=accumulate,
        sync_gradients=capture.all_reduce,
        autocast=precision == "bf16",
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


def _offload_policy(spec: StrategySpec, device: torch.device) -> OffloadPolicy:
    if spec.offload == "nvme":
        raise UnsupportedConfigError("strategy.offload 'nvme' is not implemented yet")
    if spec.offload == "cpu" and device.type == "cuda":
        return CPUOffloadPolicy()
    return OffloadPolicy()  # no offload (and nothing to offload to on a CPU run)


def check_precision(precision: str) -> None:
    if precision not in ("bf16", "fp32"):
        raise UnsupportedConfigError(
            f"training.precision {precision} is not implemented yet; use bf16 or fp32"
        )


def fsdp_mp_policy(precision: Precision) -> MixedPrecisionPolicy:
    """bf16: gather bf16 copies of the fp32 sharded masters, reduce-scatter grads in fp32."""
    check_precision(precision)
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()  # fp32 everywhere: no casting


def parallelize(
    model: nn.Module,
    plan: Plan,
    spec: StrategySpec,
    device: torch.device,
    local_world_size: int,
    *,
    precision: Precision,
) -> Parallel:
    """Wrap `model` as `plan.strategy` says, in `precision` (training.precision).
    DeepSpeed paths are refused, never replaced."""
    check_precision(precision)
    strategy = plan.strategy
    if spec.backend == "deepspeed" or plan.backend == "deepspeed" or strategy in ("zero1", "zero2"):
        raise UnsupportedConfigError(
            f"strategy {strategy} with backend deepspeed is not implemented yet; "
            "use strategy.type ddp, zero3 (backend fsdp) or fsdp-*"
        )
    if strategy == "ddp":
        if spec.offload != "none":
            raise UnsupportedConfigError("strategy.offload needs an fsdp strategy, not ddp")
        return apply_ddp(model, device, precision)
    offload = _offload_policy(spec, device)
    mp_policy = fsdp_mp_policy(precision)
    world = dist.get_world_size()
    if strategy in ("fsdp-full-shard", "zero3", "fsdp-shard-grad-op"):
        mesh = init_device_mesh(device.type, (world,))
        return apply_fsdp(
            model,
            mesh,
            reshard_after_forward=strategy != "fsdp-shard-grad-op",
            offload=offload,
            mp_policy=mp_policy,
            strategy=strategy,
        )
    if strategy == "fsdp-hybrid":
        # Replicate across nodes, shard within a node: (nodes, gpus per node).
        if world % local_world_size:
            raise UnsupportedConfigError(
                f"fsdp-hybrid needs whole nodes: world {world}, {local_world_size} per node"
            )
        mesh = init_device_mesh(
            device.type,
            (world // local_world_size, local_world_size),
            mesh_dim_names=("replicate", "shard"),
        )
        return apply_fsdp(
            model,
            mesh,
            reshard_after_forward=True,
            offload=offload,
            mp_policy=mp_policy,
            strategy=strategy,
        )
    raise UnsupportedConfigError(f"strategy {strategy!r} is not implemented yet")
