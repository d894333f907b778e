"""The resident model states of one configuration per rank (pure): parameters, gradients,
optimizer states and master weights, sharded as the strategy shards them, and what offload
moves to the host. The step's transient memory stands on them (memory.py)."""

from __future__ import annotations

from dataclasses import dataclass

from finetune_operator.planner.activations import FP32
from finetune_operator.planner.architecture import ModelShape
from finetune_operator.planner.configuration import PRECISION_BYTES, Candidate, TrainingShape
from finetune_operator.planner.loading import largest_module_parameters
from finetune_operator.planner.lora import (
    adapter_parameters,
    largest_adapter_tensor,
    qlora_base_bytes,
)
from finetune_operator.planner.zero import ZeroStates, zero_states

# bitsandbytes 8-bit blockwise optimizer: 1 byte per state value + one fp32 absmax per 256.
ADAM8BIT_BYTES_PER_STATE = 1 + FP32 / 256


@dataclass(frozen=True)
class ModelStates:
    """Resident model states per rank (bytes): what the step's phases stand on."""

    params: int
    grads: int
    optim: int
    host: int
    frozen_elems: int  # frozen base parameters (LoRA/QLoRA), for gathered-unit sizes
    zero: ZeroStates | None = None  # DeepSpeed: gradients per phase differ (planner/zero.py)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _optimizer_state_bytes(shape: TrainingShape, e: int, mixed: bool) -> float:
    """Bytes per trainable parameter of optimizer states, excluding master weights."""
    state = FP32 if mixed else e
    if shape.optimizer == "adamw":
        return 2 * state
    if shape.optimizer == "adamw8bit":
        return 2 * ADAM8BIT_BYTES_PER_STATE
    return state  # SGD with momentum: one buffer


def _fsdp_shard_elems(m: ModelShape, trainable: int, s: int) -> int | None:
    """Per-rank elements of FSDP2's Shard(0) when stacked expert tensors (experts, ...) have
    fewer rows than ranks: each rank holds ceil(E/s) whole experts, the tail ranks padding
    (torch.distributed.fsdp FSDPParam pads dim 0 to a multiple of the shard count)."""
    if not m.experts or s <= m.experts or trainable != m.total:
        return None
    per_expert = 3 * m.arch.hidden_size * m.expert_inter * m.arch.num_hidden_layers
    experts = per_expert * m.experts
    return _ceil_div(trainable - experts, s) + per_expert * _ceil_div(m.experts, s)


def model_states(m: ModelShape, shape: TrainingShape, cand: Candidate) -> ModelStates:
    """Parameters, gradients and optimizer states one rank holds (and what offload moves to
    the host), by backend: DeepSpeed's engine as planner/zero.py counts it, else DDP/FSDP2."""
    e = PRECISION_BYTES[shape.precision]
    mixed = e != FP32 and shape.master_weights is not False
    n, s = cand.world_size, cand.shard_size
    if shape.method == "full":
        trainable, frozen_bytes, frozen_elems = m.total, 0, 0
    else:
        trainable = adapter_parameters(m, shape.lora_rank, shape.lora_targets)
        frozen_elems = m.total
        frozen_bytes = qlora_base_bytes(m, e) if shape.method == "qlora" else m.total * e
        if cand.row.backend != "deepspeed":
            # PEFT keeps adapters in fp32: they are their own master weights.
            e, mixed = FP32, False
        # DeepSpeed casts the adapters to the precision's dtype with the rest of the model
        # (finetune_trainer's cast_whole_parameters, at every stage) and its optimizer keeps
        # fp32 masters of them: e-byte parameters and gradients, as for a full fine-tune.
    opt_b = _optimizer_state_bytes(shape, e, mixed)
    master = FP32 if mixed else 0
    row = cand.row
    if row.backend == "deepspeed":
        # What DeepSpeed's engine allocates, checked against it (planner/zero.py).
        z = zero_states(
            row.zero_stage,
            n,
            trainable,
            frozen_bytes,
            e,
            master + opt_b,
            fp32_master=mixed,
            offload=cand.offloads,
            grad_accumulation=shape.grad_accumulation,
            hpz=shape.hpz_partition_size,
        )
        return ModelStates(z.params, z.grads, z.optim, z.host, frozen_elems, z)
    # The torch backend (DDP and FSDP2 rows).
    # FSDP2 shards the original-dtype params; with mixed precision those are fp32 masters.
    # DDP mixed precision is an fp32 model under autocast (what the trainer runs and what
    # torch AMP means): fp32 params + fp32 grads + fp32 m, v = 4 + 4 + 8 = the textbook 16 B.
    # Without mixed precision both reduce to the textbook split (e-byte params and grads).
    pe = FP32 if mixed else e
    s = s if row.shards_params else 1
    shard = _fsdp_shard_elems(m, trainable, s) if shape.method == "full" else None
    shard = shard if shard is not None else _ceil_div(trainable, s)
    params = shard * pe + _ceil_div(frozen_bytes, s)
    grads = shard * pe
    optim = int(shard * opt_b)
    host = 0
    if cand.offloads:
        # zero1/zero2 offload the optimizer (and ZeRO-2 its fp32 gradient partitions: sharded
        # gradients go with the optimizer that owns them); zero3 and FSDP's CPUOffloadPolicy
        # move params, grads and optimizer to the host.
        moved = optim + (grads if row.shards_grads else 0)
        if "params" in row.offloadable:
            moved += params
            params = 0
        grads = 0 if row.shards_grads else grads
        optim = 0
        host = moved
    return ModelStates(params, grads, optim, host, frozen_elems)


def checkpoint_state_bytes(m: ModelShape, shape: TrainingShape, cand: Candidate) -> int:
    """Bytes of the state one rank's save captures (finetune_trainer.state.TrainState.capture;
    planner/checkpoint_memory.py says what a save holds of it). The torch backend: the
    trainable parameters as the rank holds them (DDP: all of them; FSDP2: its shard; frozen
    bases are not saved) and their optimizer states, wherever offload put them; a tied
    embedding twice, under both of its names (get_state_dict keeps both keys and the staging
    copies each). DeepSpeed (deepspeed_checkpoint): this rank's 1/N chunk of every trainable
    parameter's fp32 master and optimizer states, whatever the ZeRO stage."""
    e = PRECISION_BYTES[shape.precision]
    mixed = e != FP32 and shape.master_weights is not False
    full = shape.method == "full"
    trainable = m.total if full else adapter_parameters(m, shape.lora_rank, shape.lora_targets)
    n = cand.world_size
    if cand.row.backend == "deepspeed":
        # fp32 masters (or the fp32 parameters themselves) and the states in their dtype.
        return _ceil_div(trainable, n) * int(FP32 + _optimizer_state_bytes(shape, FP32, False))
    if not full:
        e, mixed = FP32, False  # PEFT's fp32 adapters
    pe = FP32 if mixed else e
    s = cand.shard_size if cand.row.shards_params else 1
    shard = _fsdp_shard_elems(m, trainable, s) if full else None
    shard = shard if shard is not None else _ceil_div(trainable, s)
    tied = _ceil_div(m.embedding, s) * pe if full and not m.lm_head else 0
    return shard * pe + tied + int(shard * _optimizer_state_bytes(shape, e, mixed))


def checkpoint_largest_tensor_bytes(m: ModelShape, shape: TrainingShape, cand: Candidate) -> int:
    """Bytes of the largest tensor in the state one rank's save captures (checkpoint_state_bytes;
    an s3:// root's writer buffers it whole, checkpoint_memory): the largest trainable
    parameter, or its optimizer state if wider, as the rank holds it (FSDP2: its shard;
    DeepSpeed: its 1/N fp32 chunk); LoRA: the largest fp32 adapter tensor."""
    if shape.method != "full":
        return largest_adapter_tensor(m, shape.lora_rank, shape.lora_targets) * FP32
    largest = largest_module_parameters(m)
    if cand.row.backend == "deepspeed":
        return _ceil_div(largest, cand.world_size) * FP32
    e = PRECISION_BYTES[shape.precision]
    mixed = e != FP32 and shape.master_weights is not False
    s = cand.shard_size if cand.row.shards_params else 1
    return _ceil_div(largest, s) * (FP32 if mixed else e)
