"""A full replica on every rank (DeepSpeed ZeRO-1/2) filled from an object-store prefix, each
byte of the model read from the store once per job.

Why striped reads and an all-gather, not "every rank reads whole" nor "one reader per node
broadcasts": a 70B model is 140 GB in bf16. Read whole by each of 64 ranks it is 9 TB of
egress and every rank waits on its own 140 GB GET stream; one reader per node (8 GPUs) still
reads it 8 times and leaves the store's bandwidth to 8 clients; one reader per job makes a
single client's bandwidth the bound. Striped, rank r of W reads rows [r/W, (r+1)/W) of each
tensor (the DCP load plan of a dim-0 sharded DTensor, served by byte ranges:
finetune_trainer.safetensors_ranges, the path FSDP shards take), so the job reads the model
once, spread over every node's network, and the all-gather that makes each tensor whole runs
over the collective fabric (NVLink/InfiniBand), an order of magnitude faster than the store.
Each rank fetches 1/W of the data; rank 0 the headers besides, for every rank.

Memory: beside the replica, the stripes of one group of tensors (at most STRIPE_BYTES per
rank, in the replica's dtype; a DCP load per group; the headers read once, by rank 0), plus
the raw reads in flight during a load; the gathers are in place (`gather_rows`). A directory
on a volume is read whole by every rank as before (finetune_trainer.pretrained: a node's page
cache serves its ranks, and there is no egress); so is a one-rank job."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor import empty as dtensor_empty

from finetune_operator.api.weights_reads import STRIPE_BYTES
from finetune_trainer.location import Entry, Location
from finetune_trainer.pretrained import checkpoint_keys, load_safetensors, weights_error
from finetune_trainer.safetensors_ranges import RangedSafetensorsReader, batches

log = logging.getLogger(__name__)

# STRIPE_BYTES: a rank's stripes of one DCP load at most (a larger tensor's stripe alone):
# what the striped read holds beside the replica, with the raw reads in flight (the planner
# counts both: planner.loading.striped_read_bytes). Each load reads the headers again
# (kilobytes per file).


def load_replica(model: nn.Module, weights: Path | Location) -> set[int]:
    """Read every base parameter of the (whole, materialised) `model` from `weights`: an
    object-store prefix in stripes, one per rank, all-gathered (see the module docstring);
    else as finetune_trainer.pretrained reads it. Returns the ids of the parameters filled."""
    remote = isinstance(weights, Location) and not weights.is_local
    if not remote or not dist.is_initialized() or dist.get_world_size() == 1:
        return load_safetensors(model, weights)
    assert isinstance(weights, Location)
    # The listing's refusals (no such prefix, no safetensors) are load_safetensors' own.
    if not any(e.name.endswith(".safetensors") for e in _children(weights)):
        return load_safetensors(model, weights)
    params = checkpoint_keys(model)
    world = dist.get_world_size()
    device = next(iter(params.values())).device
    mesh = init_device_mesh(device.type, (world,))
    # One reader for every group's DCP load: the headers read once, by rank 0 for all.
    reader = RangedSafetensorsReader(weights, shared=True)
    # Read (and broadcast) before any stripe is allocated: its buffers are not held beside
    # them, and a bad header is refused before the first load.
    try:
        reader.read_metadata()
    except (OSError, ValueError) as e:
        raise weights_error(weights, e) from e
    names = list(params)
    stripe_bytes = [params[n].numel() * params[n].element_size() // world for n in names]
    groups = batches(stripe_bytes, STRIPE_BYTES)
    for group in groups:
        _load_group({names[i]: params[names[i]] for i in group}, mesh, reader, weights)
    log.info(
        "pretrained weights (striped over %d ranks, rank %d, %d loads): read %d of %d bytes "
        "from %s",
        world,
        dist.get_rank(),
        len(groups),
        reader.bytes_read,
        reader.bytes_total,
        weights.url,
        extra={
            "bytes_read": reader.bytes_read,
            "bytes_total": reader.bytes_total,
            "loads": len(groups),
        },
    )
    return {id(p) for p in params.values()}


def _load_group(
    params: dict[str, nn.Parameter],
    mesh: DeviceMesh,
    reader: RangedSafetensorsReader,
    weights: Location,
) -> None:
    """One DCP load of these parameters' stripes (this rank's rows of dim 0 of each), then
    each all-gathered whole into its parameter."""
    # A scalar has no rows to split: every rank reads it (a few bytes).
    stripes: dict[str, torch.Tensor] = {
        name: dtensor_empty(*p.shape, dtype=p.dtype, device_mesh=mesh, placements=[Shard(0)])
        if p.dim()
        else torch.empty((), dtype=p.dtype, device=p.device)
        for name, p in params.items()
    }
    try:
        dcp.load(stripes, storage_reader=reader)
    # DCP wraps per-rank failures in CheckpointException, a BaseException.
    except (Exception, CheckpointException) as exc:
        raise weights_error(weights, reader.failure or exc) from exc
    for name, p in params.items():
        if isinstance(stripes[name], DTensor):
            gather_rows(p, stripes.pop(name))  # the stripe freed as it is gathered
        else:
            p.copy_(stripes.pop(name))


def gather_rows(param: torch.Tensor, stripe: DTensor) -> None:
    """All-gather every rank's rows of `stripe` (its Shard(0) chunk of `param`, torch.chunk's
    split: ceil(n/W) rows each, the last ranks fewer) into `param`, in place: this rank's rows
    are copied into their place in the parameter and the stripe freed, then the collective
    fills the other ranks' rows straight into the parameter (one all-gather when the rows
    split evenly, else one broadcast per rank that has rows).

    In place, not through a gather buffer, because the backend holds a collective's tensors
    past its `wait()`: gloo's worker thread drops its work (and so its input and output
    tensors) only after it has marked it complete (ProcessGroupGloo::runLoop), so on a busy
    host a buffer handed to the last gather of one load outlived it beside the next load's
    stripes (the 38 KB over one load's stripes that tests/trainer/test_zero3_loading.py saw in
    about 1 run in 5 under load). Handed only views of the replica, the backend keeps nothing
    alive that the replica does not. (DTensor.full_tensor held the padded gather, its
    unpadded copy and, on gloo, a concatenation besides: 3-4x the tensor.) The caller passes
    its only reference to `stripe`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = stripe.to_local()
    del stripe
    n = param.shape[0]
    chunk = -(-n // world)
    if not param.is_contiguous():
        # Not a layout the trainer builds (the materialised modules' parameters are
        # contiguous); such a parameter is gathered beside it, which the plan does not count.
        _gather_padded(param, rows, chunk, world)
        return
    mine = min(rank * chunk, n)
    param[mine : mine + rows.shape[0]].copy_(rows)
    del rows
    if n == chunk * world:
        dist.all_gather_into_tensor(param, param[mine : mine + chunk])
        return
    for src in range(world):
        first = min(src * chunk, n)
        last = min(first + chunk, n)
        if last > first:
            dist.broadcast(param[first:last], src=src)


def _gather_padded(param: torch.Tensor, rows: torch.Tensor, chunk: int, world: int) -> None:
    """A non-contiguous parameter: gathered into one padded buffer, then copied."""
    if rows.shape[0] != chunk:  # a short last chunk (or none): padded to the others' rows
        padded = torch.zeros((chunk, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        padded[: rows.shape[0]] = rows
        rows = padded
    whole = torch.empty((chunk * world, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    dist.all_gather_into_tensor(whole, rows.contiguous())
    param.copy_(whole[: param.shape[0]])


def _children(weights: Location) -> list[Entry]:
    try:
        return list(weights.children())
    except OSError as e:
        raise weights_error(weights, e) from e
