"""A DeepSpeed resume in bounded groups: no rank ever holds the whole model's state.

A DeepSpeed checkpoint (deepspeed_checkpoint) holds one full fp32 tensor per trainable
parameter and key: `model.<name>` (the master weight) and `optim.<name>.<state>`. Reading all
of them into full templates at once cost every rank 12 bytes of host memory per trainable
parameter (AdamW) while loading: ~96 GB per rank for an 8B full fine-tune. Instead:

1. The tensors are cut into groups, in parameter order, of at most `resume_chunk_budget`
   bytes (RESUME_CHUNK_BYTES, 1 GiB, or the largest tensor when that is larger). The grouping
   is a pure function of the parameters' names and full shapes, the same on every rank
   whatever the rank owns, so every rank calls DCP's load (a collective) equally often.
2. For each group, each rank builds fp32 templates of only the tensors it needs, DCP loads
   those keys (it reads just the keys of the state dict it is given), they are handed to
   DeepSpeed's fragment setters, and they are freed before the next group.

What a rank needs:
- every master weight: ZeRO-1/2 hold the low-precision weights whole on every rank (set from
  it), ZeRO-3's setter cuts the rank's partition out of the full tensor (and rank 0 writes
  the gathered low-precision copy);
- an optimizer state only where DeepSpeed's setter uses it (`owns_optimizer_fragment`): under
  ZeRO-1/2 a parameter lies in one rank's fp32 partition (two at a boundary), so at N ranks a
  rank reads ~1/N of the states (AdamW at 2 ranks: 4 + 8/2 = 8 bytes a parameter, not 12);
  under ZeRO-3 every rank holds a fragment of every parameter and reads them all.
What remains: each rank still reads the master weights in full (N times the bytes from storage
for them, and for every state under ZeRO-3); the host memory is what is bounded.

Why 1 GiB: it bounds what a resume adds to each rank's host memory (8 ranks a node: 8 GiB)
whatever the model, while the cost per group (DCP's plan exchange: a few collectives, the
metadata read, the files opened again) stays negligible against reading a GiB: an 8B full
fine-tune is ~100 groups. A tensor is never split (DCP reads a saved tensor as one item), so
a larger one (a large vocabulary's embedding) makes a group of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from finetune_operator.api.deepspeed_config import RESUME_CHUNK_BYTES, resume_chunk_budget

FP32 = 4
# Loads the checkpoint's values of the keys of the state dict it is given, in place (DCP).
Read = Callable[[dict[str, Any]], None]


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
    the tensors it read; `full_bytes` all of them (what every rank read and held before)."""

    groups: int
    budget: int
    read_bytes: int
    full_bytes: int


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


def full_shape(p: nn.Parameter) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def owns_optimizer_fragment(p: nn.Parameter) -> bool:
    """Whether DeepSpeed's `safe_set_full_optimizer_state` writes anything of `p` on this
    rank: ZeRO-3 partitions every parameter over every rank (`ds_id`); ZeRO-1/2 link a
    parameter to this rank's fp32 partition (`_hp_mapping`) only where they overlap."""
    if hasattr(p, "ds_id"):
        return True
    return getattr(p, "_hp_mapping", None) is not None


def partition_device(p: nn.Parameter) -> torch.device:
    """Where the fragment API does its arithmetic: ZeRO-3 keeps the partition in ds_tensor
    (the host with parameter offload), ZeRO-1/2 the accelerator copy."""
    ds_tensor = getattr(p, "ds_tensor", None)
    return ds_tensor.device if isinstance(ds_tensor, torch.Tensor) else p.device


def _set_master(p: nn.Parameter, value: torch.Tensor, stage3: bool) -> None:
    from deepspeed.runtime.zero import GatheredParameters
    from deepspeed.utils import safe_set_full_fp32_param

    safe_set_full_fp32_param(p, value.to(partition_device(p)))
    # The low-precision copy the forward uses.
    if stage3:
        with GatheredParameters([p], modifier_rank=0):
            if dist.get_rank() == 0:
                p.data.copy_(value.to(p.dtype))
    else:
        p.data.copy_(value.to(device=p.device, dtype=p.dtype))


def _set_state(p: nn.Parameter, key: str, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    safe_set_full_optimizer_state(p, value.to(partition_device(p)), key)


def restore_in_groups(
    params: Sequence[tuple[str, nn.Parameter]],
    state_keys: Sequence[str],
    read: Read,
    *,
    stage3: bool,
    cap: int = RESUME_CHUNK_BYTES,
) -> ResumeStats:
    """Collective (every rank, the same `params` in the same order): set the master weights
    and optimizer `state_keys` of the trainable `params` from the checkpoint, one group of
    at most `resume_chunk_budget(largest, cap)` bytes at a time (see the module docstring)."""
    entries = [
        Entry(i, key, full_shape(p).numel() * FP32)
        for i, (_, p) in enumerate(params)
        for key in ("", *state_keys)
    ]
    budget = resume_chunk_budget(max((e.nbytes for e in entries), default=0), cap)
    groups = plan_groups(entries, budget)
    read_bytes = 0
    for group in groups:
        needed = [e for e in group if not e.key or owns_optimizer_fragment(params[e.param][1])]
        # Called by every rank for every group, even with nothing to read: DCP's load is a
        # collective (its plan is exchanged).
        _restore_group(params, needed, read, stage3)
        read_bytes += sum(e.nbytes for e in needed)
    return ResumeStats(len(groups), budget, read_bytes, sum(e.nbytes for e in entries))


def _restore_group(
    params: Sequence[tuple[str, nn.Parameter]], needed: Sequence[Entry], read: Read, stage3: bool
) -> None:
    # A function of its own so that no template outlives the group (not even in a loop
    # variable) when the next group's are allocated.
    model_sd: dict[str, torch.Tensor] = {}
    optim_sd: dict[str, dict[str, torch.Tensor]] = {}
    for e in needed:
        name, p = params[e.param]
        template = torch.empty(full_shape(p), dtype=torch.float32)
        if e.key:
            optim_sd.setdefault(name, {})[e.key] = template
        else:
            model_sd[name] = template
    read({"model": model_sd, "optim": optim_sd})
    for e in needed:
        name, p = params[e.param]
        if e.key:
            _set_state(p, e.key, optim_sd[name][e.key])
        else:
            _set_master(p, model_sd[name], stage3)
