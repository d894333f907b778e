"""What one rank holds of a parameter's fp32 state under ZeRO, read out and written back on the
host, so that only this rank's part ever goes to the device.

- ZeRO-3 (`ds_id`): every parameter is partitioned over every rank; rank r holds elements
  [r*c, (r+1)*c) of the flattened parameter, c = ceil(numel/N), the last padded with zeros:
  the chunked layout's chunk (deepspeed_layout.chunk_range). Read and written with DeepSpeed's
  local API (`safe_get_local_fp32_param`, `safe_set_local_optimizer_state`, ...).
- ZeRO-1/2 (`_hp_mapping`): the flat groups are partitioned, so a parameter lies in one rank's
  fp32 partition (two or more at a boundary) as an arbitrary range of its flattened elements
  (`lp_fragment_address`); `_hp_mapping` is None on the ranks it does not touch. Saving goes
  through the gathered full tensor (`safe_get_full_fp32_param`, a collective); loading writes
  the range into the fragment, cut out of the full tensor on the host (DeepSpeed's
  `set_full_hp_param` does the same cut, but on the device, after the whole tensor went there).

Once the fp32 state is set, the low-precision weights the forward uses are refreshed from it
by DeepSpeed itself (`refresh_low_precision`): each rank copies its own fp32 partition into
its low-precision partition and the ranks all-gather them, as after an optimizer step. No rank
needs a master weight it does not own a part of.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def full_shape(p: nn.Parameter) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def is_zero3(p: nn.Parameter) -> bool:
    return hasattr(p, "ds_id")


def owns_fragment(p: nn.Parameter) -> bool:
    """Whether this rank holds any fp32 state of `p` (and so reads it at a resume): ZeRO-3
    partitions every parameter over every rank; ZeRO-1/2 link a parameter to this rank's fp32
    partition (`_hp_mapping`) only where they overlap."""
    if is_zero3(p):
        return True
    return getattr(p, "_hp_mapping", None) is not None


def _zero3_partition_size(p: nn.Parameter, world: int) -> int:
    size = int(p.ds_tensor.numel())  # type: ignore[attr-defined]
    numel = full_shape(p).numel()
    if size != -(-numel // world):
        # Another partitioning than the chunked layout's (MiCS's shard groups, which DeepSpeed
        # 0.19 removed): not supported. hpZ keeps this primary partition over the whole world;
        # its secondary copy over the hpZ group (ds_secondary_tensor) is rebuilt from it.
        raise RuntimeError(
            f"ZeRO-3 partition of {size} elements for a {numel}-element parameter at "
            f"{world} ranks: expected ceil(numel/world) = {-(-numel // world)}"
        )
    return size


def local_chunk(p: nn.Parameter, key: str, start: int, length: int, world: int) -> torch.Tensor:
    """A fresh host copy of elements [start, start+length) of the flattened fp32 master weight
    (`key` "") or optimizer state `key` of `p`: this rank's chunk of the chunked layout.
    Collective under ZeRO-1/2 (every rank, same order); local under ZeRO-3, where the chunk
    is this rank's partition without its padding."""
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_optimizer_state,
    )

    if is_zero3(p):
        _zero3_partition_size(p, world)
        part: torch.Tensor = (
            safe_get_local_optimizer_state(p, key) if key else safe_get_local_fp32_param(p)
        )
        return part.detach().reshape(-1)[:length].to("cpu", copy=True)
    full: torch.Tensor = (
        safe_get_full_optimizer_state(p, key) if key else safe_get_full_fp32_param(p)
    )
    return full.detach().reshape(-1)[start : start + length].to("cpu", copy=True)


def set_zero3_partition(p: nn.Parameter, key: str, chunk: torch.Tensor, world: int) -> None:
    """Set this rank's ZeRO-3 partition of `p`'s master (`key` "") or state `key` from its
    chunk (host, unpadded): only the partition goes to the device."""
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    size = _zero3_partition_size(p, world)
    value = chunk.reshape(-1).to(torch.float32)
    if value.numel() < size:
        value = F.pad(value, (0, size - value.numel()))
    if key:
        safe_set_local_optimizer_state(p, value, key)
    else:
        safe_set_local_fp32_param(p, value)


def fragment_range(p: nn.Parameter) -> tuple[int, int]:
    """(start, length) of the range of `p`'s flattened elements in this rank's ZeRO-1/2
    partition ((0, 0) where it holds none)."""
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return 0, 0
    address = mapping.lp_fragment_address
    return int(address.start), int(address.numel)


def set_zero12_fragment(p: nn.Parameter, key: str, values: torch.Tensor, start: int = 0) -> None:
    """Set the part of `p`'s fp32 master (`key` "") or state `key` that lies in this rank's
    ZeRO-1/2 partition from `values` (host, any shape), elements [start, start+numel) of the
    flattened tensor: the whole tensor (start 0), or just the fragment. The range is cut on the
    host, only it goes to the device. Nothing where this rank holds none."""
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return
    offset, length = fragment_range(p)
    if offset < start or offset + length > start + values.numel():
        raise ValueError(
            f"elements [{start}, {start + values.numel()}) do not hold this rank's fragment "
            f"[{offset}, {offset + length}) of a {full_shape(p).numel()}-element parameter"
        )
    fragment = values.reshape(-1).narrow(0, offset - start, length)
    mapping.get_hp_fragment(key or None).data.copy_(fragment)


def refresh_low_precision(zero: Any, *, stage3: bool) -> None:
    """Collective: the low-precision weights the forward uses, from the fp32 partitions just
    loaded, the way DeepSpeed does it after an optimizer step."""
    if not stage3:
        # DeepSpeedZeroOptimizer / BF16_Optimizer: copy this rank's fp32 partition into its
        # low-precision partition, all-gather the partitions into every rank's whole copy.
        zero.update_lp_params()
        return
    # DeepSpeedZeroOptimizer_Stage3's end of step (step() and _post_step()): each sub-group's
    # fp32 partition into its low-precision partition (the parameters' ds_tensor), then the
    # persistent parameters (small ones every rank keeps whole) gathered again.
    for i in range(len(zero.fp16_groups)):
        zero._reassign_or_swap_out_partitioned_parameters(i)
    if zero.persistent_parameters:
        zero.persistent_parameters[0].all_gather(zero.persistent_parameters)
    zero.invalidate_secondary_tensor()
