"""Wrap the model for the planned strategy: one short function per strategy.

Every strategy returns a `Parallel` with the same two hooks the loop uses:
`accumulate(last)` around each micro-batch and `sync_gradients()` after the step's sync point.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import StrategySpec
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.model import decoder_layers

BUCKET_BYTES = 25 * 2**20


@dataclass
class Parallel:
    model: nn.Module
    strategy: str
    accumulate: Callable[[bool], contextlib.AbstractContextManager[None]] = field(
        default=lambda last: contextlib.nullcontext()
    )
    sync_gradients: Callable[[], None] = field(default=lambda: None)


def _all_reduce_grads(params: list[nn.Parameter], world: int) -> None:
    """Average gradients over ranks in flat buckets (one collective per ~25 MiB)."""
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if bucket:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)
            flat.div_(world)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        bucket, size = [], 0

    for g in grads:
        if bucket and (
            g.dtype != bucket[0].dtype or size + g.numel() * g.element_size() > BUCKET_BYTES
        ):
            flush()
        bucket.append(g)
        size += g.numel() * g.element_size()
    flush()


def apply_ddp(model: nn.Module, device: torch.device) -> Parallel:
    # Gradients are reduced explicitly after the step's sync point instead of inside backward:
    # the loop then times this rank's compute without time spent waiting for slower peers,
    # which is what straggler detection reads. The cost is no overlap of the gradient
    # all-reduce with backward.
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        forward_sync_buffers=False,  # no collective hidden in forward
    )
    params = [p for p in ddp.parameters() if p.requires_grad]
    world = dist.get_world_size()
    return Parallel(
        model=ddp,
        strategy="ddp",
        accumulate=lambda last: ddp.no_sync(),
        sync_gradients=lambda: _all_reduce_grads(params, world),
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
    strategy: str,
) -> Parallel:
    # Shard each decoder layer first, then the root: each layer becomes its own all-gather
    # unit (only one layer's full weights live at a time), and the root picks up what is
    # left (embeddings, final norm, LM head) as one more unit.
    layers = decoder_layers(model)
    if not layers:
        raise UnsupportedConfigError(
            f"strategy {strategy}: found no decoder layers to shard in {type(model).__name__}"
        )
    for layer in layers:
        fully_shard(
            layer, mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload
        )
    # The root's parameters are needed again right at the start of backward (LM head):
    # resharding them after forward would only re-gather them immediately.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, offload_policy=offload)
    assert isinstance(model, FSDPModule)
    return Parallel(model=model, strategy=strategy, accumulate=_fsdp_accumulate(model))


def _offload_policy(spec: StrategySpec, device: torch.device) -> OffloadPolicy:
    if spec.offload == "nvme":
        raise UnsupportedConfigError("strategy.offload 'nvme' is not implemented yet")
    if spec.offload == "cpu" and device.type == "cuda":
        return CPUOffloadPolicy()
    return OffloadPolicy()  # no offload (and nothing to offload to on a CPU run)


def parallelize(
    model: nn.Module,
    plan: Plan,
    spec: StrategySpec,
    device: torch.device,
    local_world_size: int,
) -> Parallel:
    """Wrap `model` as `plan.strategy` says. DeepSpeed paths are refused, never replaced."""
    strategy = plan.strategy
    if spec.backend == "deepspeed" or plan.backend == "deepspeed" or strategy in ("zero1", "zero2"):
        raise UnsupportedConfigError(
            f"strategy {strategy} with backend deepspeed is not implemented yet; "
            "use strategy.type ddp, zero3 (backend fsdp) or fsdp-*"
        )
    if strategy == "ddp":
        if spec.offload != "none":
            raise UnsupportedConfigError("strategy.offload needs an fsdp strategy, not ddp")
        return apply_ddp(model, device)
    offload = _offload_policy(spec, device)
    world = dist.get_world_size()
    if strategy in ("fsdp-full-shard", "zero3", "fsdp-shard-grad-op"):
        mesh = init_device_mesh(device.type, (world,))
        return apply_fsdp(
            model,
            mesh,
            reshard_after_forward=strategy != "fsdp-shard-grad-op",
            offload=offload,
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
            model, mesh, reshard_after_forward=True, offload=offload, strategy=strategy
        )
    raise UnsupportedConfigError(f"strategy {strategy!r} is not implemented yet")
