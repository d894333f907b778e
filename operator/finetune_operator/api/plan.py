"""The planner's output contract (DESIGN.md §4): written to status.plan, the ConfigMap and
`ftjob plan -o json`. Pure data; the planner package computes it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from finetune_operator.api.base import ApiModel
from finetune_operator.api.spec import (
    ModelArchitecture,
    Offload,
    StrategyName,
)
from finetune_operator.api.strategies import BackendName


class MemoryBreakdown(ApiModel):
    """Bytes per GPU (per process on CPU runs)."""

    parameters: int = Field(..., ge=0, description="Resident parameter bytes (sharded share).")
    gradients: int = Field(..., ge=0, description="Resident gradient bytes.")
    optimizer: int = Field(..., ge=0, description="Optimizer states and master weights.")
    activations: int = Field(..., ge=0, description="Activations at the step's peak.")
    buffers: int = Field(..., ge=0, description="Transient buffers: gathers, buckets, logits.")
    peak: int = Field(
        ..., ge=0, description="Peak allocated tensor memory (torch.cuda.max_memory_allocated)."
    )
    reserved: int = Field(
        ..., ge=0, description="Peak as reserved by the caching allocator (max_memory_reserved)."
    )
    total: int = Field(
        ...,
        ge=0,
        description="reserved + CUDA context and library workspaces (on CPU: the process's "
        "Python, torch and torchrun runtime): what must fit.",
    )


class Plan(ApiModel):
    device: Literal["gpu", "cpu"] = Field(
        "gpu", description="What a rank runs on: memory figures are per GPU, or per process on cpu."
    )
    fits: bool = Field(..., description="Whether the chosen configuration fits with headroom.")
    objective: str = Field(
        "fewest-gpus",
        description="What chose among the fits: fewest-gpus, fastest, lowest-cost, or fixed "
        "(the node range or a pin fixes the world size).",
    )
    world_size: int = Field(..., ge=1, description="Total processes (GPUs).")
    nodes: int = Field(..., ge=1, description="Worker pods.")
    gpus_per_node: int = Field(..., ge=1, description="Processes per worker pod.")
    strategy: StrategyName = Field(..., description="Sharding strategy.")
    offload: Offload = Field(
        "none",
        description="What the trainer offloads: none where strategy.offload would move "
        "nothing (FSDP2 on a CPU device keeps its states in host memory already; the "
        "reason says so).",
    )
    backend: BackendName = Field(
        "fsdp",
        description="What runs the strategy, in strategy.backend's names: fsdp (torch DDP "
        "and FSDP2) or deepspeed.",
    )
    micro_batch_size: int = Field(..., ge=1, description="Samples per rank per forward.")
    gradient_accumulation_steps: int = Field(..., ge=1, description="Micro-batches per step.")
    activation_checkpointing: bool = Field(..., description="Recompute activations.")
    compiled_blocks: bool = Field(
        False,
        description=(
            "The trainer torch.compiles each decoder block (CUDA, torch backend); the "
            "activation memory is planned for it."
        ),
    )
    gpu_memory_bytes: int = Field(..., ge=0, description="Memory of one GPU (or process).")
    headroom: float = Field(..., description="1 - total/gpuMemoryBytes.")
    estimated_step_seconds: float = Field(..., ge=0, description="Modelled optimizer-step time.")
    tokens_per_second: float = Field(0.0, ge=0, description="Modelled throughput, all ranks.")
    gpu_hours: float = Field(
        0.0, ge=0, description="Modelled GPU-hours for the whole job (device cpu: process-hours)."
    )
    reason: str = Field(..., description="Why this plan (or why nothing fits).")
    memory: MemoryBreakdown
    candidates_evaluated: int = Field(0, ge=0, description="Configurations the search tried.")
    load_peak_bytes: int = Field(
        0,
        ge=0,
        description=(
            "Device bytes per GPU while loading: the rank's parameter shards plus the largest "
            "module in fp32 (the model is built on meta, sharded, then materialised; "
            "DeepSpeed ZeRO-3: partitions under zero.Init plus that module gathered; "
            "ZeRO-1/2: the whole replica, in the training dtype, plus that module; DDP and "
            "ZeRO-1/2 reading object-store weights in stripes: the replica plus the larger of "
            "that module and one load's stripes, with the reads in flight on a CPU device; on a "
            "GPU those reads are host memory, which the plan checks against resources.memory)."
        ),
    )
    checkpoint_bytes: int = Field(
        0,
        ge=0,
        description=(
            "Bytes of one checkpoint, all ranks together: the trainable parameters in fp32 "
            "and their optimizer states (what a save writes and a resume reads)."
        ),
    )
    architecture: ModelArchitecture | None = Field(
        None,
        description=(
            "The architecture the planner resolved (spec, catalog or config.json): what the "
            "trainer builds for an inline model."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_checkpointing_mode(cls, data: Any) -> Any:
        # Plans written before activationCheckpointing was the one name (status.plan, a job's
        # ConfigMap) carried a redundant checkpointingMode: read them, drop it.
        if isinstance(data, dict) and "checkpointingMode" in data:
            data = {k: v for k, v in data.items() if k != "checkpointingMode"}
        return data

    @field_validator("backend", mode="before")
    @classmethod
    def _legacy_backend(cls, value: Any) -> Any:
        # Plans written before the backend names followed the spec said "torch" for fsdp:
        # a status or ConfigMap of such a job still reads.
        return "fsdp" if value == "torch" else value
