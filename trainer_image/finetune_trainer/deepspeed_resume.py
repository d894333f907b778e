"""A DeepSpeed resume in bounded groups, each rank reading only what it holds.

A DeepSpeed checkpoint (deepspeed_checkpoint) holds one fp32 tensor per trainable parameter and
key: the master weight and each optimizer state, in the chunked layout (each rank's chunk of
the flattened tensor a chunk of its own) or the whole layout written before it
(deepspeed_layout). Reading all of them into full templates at once cost every rank 12 bytes of
host memory per trainable parameter (AdamW): ~96 GB per rank for an 8B full fine-tune; and every
rank reading every tensor reads the checkpoint N times from storage. Instead:

1. The tensors are cut into groups, in parameter order, of at most `resume_chunk_budget`
   bytes (RESUME_CHUNK_BYTES, 1 GiB, or the largest tensor when that is larger). The grouping
   is a pure function of the parameters' names and full shapes, the same on every rank
   whatever the rank holds, so every rank calls DCP's load (a collective) equally often.
2. For each group, each rank builds fp32 templates of only what it holds (deepspeed_fragments),
   DCP loads those (it reads just the keys of the state dict it is given, and of a chunked
   tensor just the saved chunks that overlap the range asked for), they are cut on the host and
   written into ZeRO's partitions, and freed before the next group.
3. Then (deepspeed_checkpoint) the low-precision weights are refreshed from the fp32
   partitions by DeepSpeed's own end-of-step copy and all-gather (`refresh_low_precision`):
   no rank reads a master weight for them.

What a rank reads (N ranks saved, M resume):
- ZeRO-3: its partition of every tensor. Chunked: the saved chunks overlapping it, at most
  ceil(N/M)+1 of them a tensor, each read whole: ~1/M of the checkpoint (exactly its own
  chunks when M == N). Whole (old checkpoints): every tensor whole, the old N-fold cost;
  only its partition is kept and sent to the device.
- ZeRO-1/2: of each parameter overlapping its fp32 partition, its fragment (an arbitrary
  range of the flattened tensor: `lp_fragment_address`). Chunked: DCP is asked for just that
  range (deepspeed_layout.RangeLoadPlanner) and reads the saved chunks overlapping it, each
  whole: ~1/M of the checkpoint plus, per partition boundary, the one or two saved chunks
  there read by both neighbours. Whole (old checkpoints): those parameters' tensors whole,
  the boundary ones by both neighbours.

A whole-layout tensor cannot be read in part: DCP's storage readers (FileSystemReader,
FsspecReader) `torch.load` a saved item whole before narrowing it to what was asked, so a
narrower template would change what a rank holds, not what it reads.

Why 1 GiB: it bounds what a resume adds to each rank's host memory (8 ranks a node: 8 GiB)
whatever the model, while the cost per group (DCP's plan exchange: a few collectives, the
metadata read, the files opened again) stays negligible against reading a GiB: an 8B full
fine-tune is ~100 groups. A tensor is never split across groups (a whole-layout tensor is read
as one item), so a larger one (a large vocabulary's embedding) makes a group of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from finetune_operator.api.deepspeed_config import RESUME_CHUNK_BYTES, resume_chunk_budget
from finetune_trainer.deepspeed_fragments import (
    fragment_range,
    full_shape,
    owns_fragment,
    set_zero3_partition,
    set_zero12_fragment,
)
from finetune_trainer.deepspeed_layout import (
    CHUNKED,
    ChunkedLayout,
    RangeLoadPlanner,
    chunk_range,
)
from finetune_trainer.state import Read

FP32 = 4


@dataclass(frozen=True)
class Entry:
    """One saved tensor: parameter `param` (index among the trainable ones), `key` "" for
    its master weight, else the optimizer state's name; `nbytes` of the full fp32 tensor."""

    param: int
    key: str
    nbytes: int


@dataclass(frozen=True)
class ResumeStats:
    """What one rank's resume did: `groups` DCP loads of at most `budget` bytes; `read_bytes`
    the bytes of the templates it asked DCP to fill (what it held: its chunks, or the whole
    tensors it needed); `full_bytes` all of the checkpoint's tensors; `chunked` its layout.
    (What a rank reads from storage is at least `read_bytes`: a saved chunk is read whole.)"""

    groups: int
    budget: int
    read_bytes: int
    full_bytes: int
    chunked: bool


def plan_groups(entries: Sequence[Entry], budget: int) -> list[list[Entry]]:
    """Consecutive entries, each group at most `budget` bytes (a larger entry alone)."""
    groups: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for e in entries:
        if current and size + e.nbytes > budget:
            groups.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current:
        groups.append(current)
    return groups


def restore_in_groups(
    params: Sequence[tuple[str, nn.Parameter]],
    state_keys: Sequence[str],
    read: Read,
    *,
    stage3: bool,
    chunked: bool,
    cap: int = RESUME_CHUNK_BYTES,
) -> ResumeStats:
    """Collective (every rank, the same `params` in the same order): set the master weights
    and optimizer `state_keys` of the trainable `params` from the checkpoint (`chunked` or
    whole layout), one group of at most `resume_chunk_budget(largest, cap)` bytes at a time
    (see the module docstring). The low-precision weights are the caller's to refresh
    (deepspeed_fragments.refresh_low_precision)."""
    entries = [
        Entry(i, key, full_shape(p).numel() * FP32)
        for i, (_, p) in enumerate(params)
        for key in ("", *state_keys)
    ]
    budget = resume_chunk_budget(max((e.nbytes for e in entries), default=0), cap)
    groups = plan_groups(entries, budget)
    loader = _GroupLoader(params, read, stage3=stage3, chunked=chunked)
    read_bytes = 0
    for group in groups:
        # Called by every rank for every group, even with nothing to read: DCP's load is a
        # collective (its plan is exchanged).
        read_bytes += loader.restore([e for e in group if owns_fragment(params[e.param][1])])
    return ResumeStats(len(groups), budget, read_bytes, sum(e.nbytes for e in entries), chunked)


class _GroupLoader:
    """Reads one group's templates and hands them to ZeRO's partitions."""

    def __init__(
        self,
        params: Sequence[tuple[str, nn.Parameter]],
        read: Read,
        *,
        stage3: bool,
        chunked: bool,
    ) -> None:
        self.params, self.read, self.stage3 = params, read, stage3
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.layout = ChunkedLayout() if chunked else None

    def _template(self, p: nn.Parameter) -> torch.Tensor:
        numel = full_shape(p).numel()
        if self.layout is None:
            return torch.empty(full_shape(p), dtype=torch.float32)  # read whole anyway
        if self.stage3:
            return self.layout.template(numel)  # only this rank's chunk
        # ZeRO-1/2: just the fragment, an arbitrary range of the flattened tensor: read by
        # RangeLoadPlanner (the saved chunks overlapping it).
        return torch.empty(fragment_range(p)[1], dtype=torch.float32)

    def restore(self, needed: Sequence[Entry]) -> int:
        """Read and set the `needed` entries; returns the template bytes. A method of its own
        so that no template outlives the group when the next group's are allocated."""
        model_sd: dict[str, torch.Tensor] = {}
        optim_sd: dict[str, dict[str, torch.Tensor]] = {}
        for e in needed:
            name, p = self.params[e.param]
            if e.key:
                optim_sd.setdefault(name, {})[e.key] = self._template(p)
            else:
                model_sd[name] = self._template(p)
        if self.layout is None:
            self.read({"model": model_sd, "optim": optim_sd})
        elif self.stage3:
            self.read({"model": {CHUNKED: model_sd}, "optim": {CHUNKED: optim_sd}})
        else:
            starts = {_chunked_key(self.params[e.param][0], e.key): (
                fragment_range(self.params[e.param][1])[0]) for e in needed}  # fmt: skip
            self.read(
                {"model": {CHUNKED: model_sd}, "optim": {CHUNKED: optim_sd}},
                planner=RangeLoadPlanner(starts),
            )
        nbytes = 0
        for e in needed:
            name, p = self.params[e.param]
            value = optim_sd[name][e.key] if e.key else model_sd[name]
            local = value.to_local() if isinstance(value, DTensor) else value
            nbytes += local.numel() * FP32
            if not self.stage3:
                # The fragment alone (chunked), or the whole tensor to cut it from.
                start = fragment_range(p)[0] if self.layout is not None else 0
                set_zero12_fragment(p, e.key, local, start)
                continue
            if self.layout is None:
                # A whole tensor: this rank's partition cut out on the host.
                start, length = chunk_range(local.numel(), self.world, self.rank)
                local = local.reshape(-1).narrow(0, start, length)
            set_zero3_partition(p, e.key, local, self.world)
        return nbytes


def _chunked_key(name: str, key: str) -> str:
    """The flattened (DCP) key of parameter `name`'s master (`key` "") or state `key` in the
    chunked layout (deepspeed_layout.saved_shapes)."""
    return f"optim.{CHUNKED}.{name}.{key}" if key else f"model.{CHUNKED}.{name}"
