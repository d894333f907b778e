"""One fully specified training configuration, as the planner searches them (pure): what one
rank computes per micro-batch (`TrainingShape`) and how the states are placed (`Candidate`)."""

from __future__ import annotations

from dataclasses import dataclass

from finetune_operator.api.spec import (
    AttentionImpl,
    MethodType,
    Offload,
    OptimizerName,
    Precision,
    StrategyName,
)
from finetune_operator.api.strategies import STRATEGIES, Strategy

PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class TrainingShape:
    """What one rank computes per micro-batch, independent of how states are sharded."""

    micro_batch_size: int
    seq_len: int
    precision: Precision = "bf16"
    optimizer: OptimizerName = "adamw"
    method: MethodType = "full"
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lora_dropout: float = 0.05
    attention: AttentionImpl = "sdpa"
    checkpointing: bool = False
    grad_accumulation: int = 1
    # None: fp32 master weights iff precision is bf16/fp16 (mixed precision). False models
    # pure-bf16 training (params, grads and Adam states all in the compute dtype).
    master_weights: bool | None = None
    # The trainer torch.compiles each decoder block (its default; FT_COMPILE=0 turns it off)
    # where `compiles_blocks` says: what the blocks save for backward follows (compiled.py).
    compile_blocks: bool = False
    # ZeRO++ hpZ's group size (the user's deepspeedConfig: api.deepspeed_config.HPZ_KEY); 1:
    # none. ZeRO-3 then keeps a secondary parameter partition over the group (planner/zero.py).
    hpz_partition_size: int = 1


@dataclass(frozen=True)
class Candidate:
    """How states are placed: strategy, world size, node shape, offload, device kind."""

    strategy: StrategyName
    world_size: int = 1
    gpus_per_node: int = 1
    offload: Offload = "none"
    cuda: bool = True

    @property
    def row(self) -> Strategy:
        """What the strategy shards and on which backend (api.strategies): the row the bare
        name means (zero3 is DeepSpeed's; the planner passes fsdp-full-shard for FSDP2's)."""
        return STRATEGIES.canonical(self.strategy)

    @property
    def offloads(self) -> bool:
        """Whether `offload` moves states off the device as the trainer runs this candidate:
        DeepSpeed on any device (on its CPU accelerator the offloaded states go to its host
        buffers, in the same RAM), FSDP2 only from a GPU (finetune_trainer.parallelize gives a
        CPU run no CPUOffloadPolicy: there is nowhere else to put them)."""
        return self.offload != "none" and (self.cuda or self.row.backend == "deepspeed")

    @property
    def shard_size(self) -> int:
        """Ranks a fully sharded state is split over (hybrid: within one node)."""
        if self.row.shard_within_node:
            return min(self.world_size, self.gpus_per_node)
        return self.world_size
