"""Build, shard and materialise the job's model: the order that keeps every rank's load peak
at its shards plus one module (DESIGN.md §6, loading at scale).

1. build on the meta device (finetune_trainer.model.build_meta_model): shapes only;
2. sharded strategies: wrap first (`fully_shard` on meta tensors only records the sharding),
   then materialise, so each rank allocates and fills only its shards;
3. DDP: materialise first (a full replica per rank is what DDP is), then wrap;
4. DeepSpeed ZeRO-3: built partitioned under `deepspeed.zero.Init` and filled one module at a
   time (finetune_trainer.deepspeed_loading); ZeRO-1/2 keep a full replica, like DDP, built
   directly in the engine's parameter dtype (from s3://, read in one stripe per rank and
   all-gathered: finetune_trainer.replica_loading).
QLoRA's base is quantised while loading and arrives materialised."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from finetune_operator.api.deepspeed_config import uses_deepspeed
from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.api.plan import Plan
from finetune_operator.api.strategies import STRATEGIES
from finetune_trainer.materialize import materialize
from finetune_trainer.model import build_meta_model, is_meta, weights_source
from finetune_trainer.parallelize import Parallel, parallelize
from finetune_trainer.pretrained import load_safetensors
from finetune_trainer.replica_loading import load_replica


def shards_parameters(plan: Plan) -> bool:
    """Whether the plan's wrapper accepts meta tensors and shards them (FSDP2)."""
    return STRATEGIES.resolve(plan.strategy, plan.backend).shards_params


def load_parallel_model(
    job: JobConfig,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    local_world_size: int,
    *,
    compile_model: bool = False,
    data_cache_dir: Path | None = None,
) -> Parallel:
    """Build on meta, shard, materialise (see the module docstring); `compile_model` compiles
    the decoder blocks (parallelize.compile_blocks: lazy, so the meta model is fine);
    `data_cache_dir`: the pod's data cache, where an s3:// model's config is fetched to."""
    spec = job.spec
    store = spec.storage.object_store
    if uses_deepspeed(job.plan):
        return _deepspeed_model(job, tokenizer, device, data_cache_dir)
    model = build_meta_model(
        spec.model,
        spec.method,
        tokenizer,
        device,
        # One resolution: the planner's (catalog, config.json or spec) travels in the plan.
        architecture=spec.model.architecture or job.plan.architecture,
        activation_checkpointing=job.plan.activation_checkpointing,
        precision=spec.training.precision,
        object_store=store,
        cache_dir=data_cache_dir,
    )
    weights = weights_source(spec.model, store)
    seed = spec.training.seed
    # FSDP2's CPUOffloadPolicy wants its shards on the host from the start (they move to the
    # GPU per unit while computing), so they are materialised there.
    # (the condition of parallelize.offload_policy, on the plan's offload: what runs)
    offloaded = job.plan.offload == "cpu" and device.type == "cuda"
    init_device = torch.device("cpu") if offloaded else device

    sharded = shards_parameters(job.plan)

    def fill(m: nn.Module) -> None:
        if is_meta(m):
            # A DDP replica from s3:// is read in stripes and all-gathered, like ZeRO-1/2's
            # (replica_loading): the job reads the model once, not once per rank.
            load = load_safetensors if sharded else load_replica
            materialize(m, init_device, seed=seed, weights=weights, load=load)

    if not sharded:
        fill(model)
    parallel = parallelize(
        model,
        job.plan,
        device,
        local_world_size,
        precision=spec.training.precision,
        compile_model=compile_model,
    )
    if sharded:
        fill(parallel.model)
    return parallel


def _deepspeed_model(
    job: JobConfig,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    data_cache_dir: Path | None = None,
) -> Parallel:
    """ZeRO-3: built partitioned under zero.Init and filled module by module
    (deepspeed_loading); ZeRO-1/2 hold a full replica on every rank by definition:
    materialised whole, like DDP (from an object-store prefix, read in stripes and
    all-gathered: replica_loading). The engine is created at attach_optimizer."""
    from finetune_operator.api.deepspeed_config import zero_stage
    from finetune_trainer.deepspeed_engine import (
        cast_whole_parameters,
        deepspeed_parallel,
        job_deepspeed_config,
        param_dtype,
    )

    spec = job.spec
    store = spec.storage.object_store
    if zero_stage(job.plan.strategy) == 3:
        from finetune_trainer.deepspeed_loading import load_zero3_model

        model = load_zero3_model(job, tokenizer, device, data_cache_dir)
        return deepspeed_parallel(model, job, device)
    model = build_meta_model(
        spec.model,
        spec.method,
        tokenizer,
        device,
        architecture=spec.model.architecture or job.plan.architecture,
        activation_checkpointing=job.plan.activation_checkpointing,
        precision=spec.training.precision,
        object_store=store,
        cache_dir=data_cache_dir,
    )
    # The replica is allocated in the dtype the engine would cast it to at initialize (bf16
    # under mixed precision), not fp32 then cast: half the load peak (8B: 16 GB, not 32 GB,
    # per GPU). The values are the same: each module is still initialised (or read) whole in
    # fp32 and rounded on copy, and the engine's fp32 master weights are made from the bf16
    # parameters either way.
    config, _ = job_deepspeed_config(job)
    cast_whole_parameters(model, param_dtype(config))
    if is_meta(model):
        # From s3://, each rank reads a stripe and the replica is all-gathered: the job
        # reads the model once (replica_loading says why not once per rank or per node).
        materialize(
            model,
            device,
            seed=spec.training.seed,
            weights=weights_source(spec.model, store),
            load=load_replica,
        )
    return deepspeed_parallel(model, job, device)
