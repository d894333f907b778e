"""DeepSpeed ZeRO model states per rank, as DeepSpeed's engine allocates them (pure).

Mirrors DeepSpeed 0.19's structures (runtime/zero/stage_1_and_2.py `DeepSpeedZeroOptimizer`,
runtime/zero/stage3.py `DeepSpeedZeroOptimizer_Stage3`), checked tensor by tensor against a
live engine by bench/deepspeed_memory.py (within 5% per stage, world size and offload). For
mixed precision with Adam, per trainable parameter P over N data-parallel ranks (e = 2 bytes):

  stage 1/2  bit16_groups_flat: the e-byte working copy, whole on every rank (e·P);
             single_partition_of_fp32_groups: fp32 master partition (4P/N) and, in
             optimizer.state, exp_avg/exp_avg_sq (8P/N);
             gradients: none in forward (freed at the previous step); in backward the
             reduced e-byte partition (averaged_gradients / grads_in_partition, e·P/N: in
             0.19 ZeRO-1 reduces in backward like ZeRO-2); at the step an fp32 copy
             (`single_partition_of_fp32_groups[i].grad`, 4P/N) cast from a flattened e-byte
             copy of it: partition, copy and fp32 alive together during the cast.
             offload_optimizer: master, moments and the fp32 gradient partition (allocated
             once, kept) on the host, plus `param_buffer_of_bit16_for_cpu_offload_groups`
             (e·P/N) the updated weights are copied back through; no gradient on the device.
  stage 3    lp_param_buffer: the e-byte partition (e·P/N); fp32 master + moments (12P/N);
             grad_partitions_flat_buffer: e-byte gradient partition allocated at init and
             kept (e·P/N in every phase); at the step `fp32_partitioned_groups_flat[i].grad`
             (4P/N), cast from a flattened e-byte copy of the partition.
             offload_optimizer: master, moments, both gradient partitions on the host;
             offload_param: the e-byte partition on the host too.

hpZ (ZeRO++ `zero_hpz_partition_size` H > 1, stage 3): each parameter also keeps a secondary
e-byte partition over its group of H ranks (`ds_secondary_tensor`: ceil(numel/N)·N/H elements),
made when a gathered parameter is partitioned again in forward and backward and freed after the
step: e·P/H beside the primary partition (on the host with offload_param, as the primary).
DeepSpeed forms the group only where min(H, N) divides N (api.deepspeed_config.hpz_group).

Gradient accumulation > 1 keeps the backward partition through forward; with offload, stage
1/2 also accumulate in host buffers (`accumulated_grads_in_cpu`, e·P/N; from the source, not
measured by the bench).
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune_operator.api.deepspeed_config import hpz_group

FP32 = 4


@dataclass(frozen=True)
class ZeroStates:
    """Per-rank bytes. `grads` is what the optimizer step holds (the breakdown's figure);
    `grads_forward`/`grads_backward` what forward and backward hold; `step_transient` the
    extra e-byte partition alive while the step casts gradients to fp32; `host` everything
    offloaded to CPU RAM."""

    params: int
    grads: int
    grads_forward: int
    grads_backward: int
    step_transient: int
    optim: int
    host: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def zero_states(
    stage: int,
    world: int,
    trainable: int,
    frozen_bytes: int,
    e: int,
    optimizer_bytes: float,
    *,
    fp32_master: bool,
    offload: bool,
    grad_accumulation: int = 1,
    hpz: int = 1,
) -> ZeroStates:
    """Model states of ZeRO `stage` over `world` ranks for `trainable` parameters held in
    e-byte precision, with `optimizer_bytes` per parameter of master + optimizer states
    (12 for mixed-precision Adam: `fp32_master`) and `frozen_bytes` of frozen weights (stage 3
    shards them)."""
    part = _ceil_div(trainable, world)
    grad_e = part * e
    # The gradient partition the step hands the optimizer is in the master weights' dtype
    # (fp32 for mixed precision; the working dtype otherwise).
    grad_step = part * (FP32 if fp32_master else e)
    optim = int(part * optimizer_bytes)
    if stage == 3:
        params = grad_e + _ceil_div(frozen_bytes, world)
        group = hpz_group(hpz, world)
        if group > 1:
            # The secondary partition of every parameter, trainable and frozen (module doc).
            params += _ceil_div(trainable * e + frozen_bytes, group)
        if offload:
            # offload_param + offload_optimizer: nothing of the model states on the device.
            host = params + optim + grad_e + grad_step
            return ZeroStates(0, 0, 0, 0, 0, 0, host)
        return ZeroStates(params, grad_e + grad_step, grad_e, grad_e, grad_e, optim, 0)
    params = trainable * e + frozen_bytes
    accumulating = grad_accumulation > 1
    if offload:
        host = optim + grad_step + grad_e + (grad_e if accumulating else 0)
        return ZeroStates(params, 0, 0, 0, 0, 0, host)
    fwd = grad_e if accumulating else 0
    # The cast flattens the partition into a new e-byte copy first: both alive beside fp32.
    return ZeroStates(params, grad_step, fwd, grad_e, 2 * grad_e, optim, 0)
