"""FineTuneJob spec (DESIGN.md §3). The CRD schema is generated from these models."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from finetune_operator.api import limits as lim
from finetune_operator.api.base import SpecModel
from finetune_operator.api.storage import StorageSpec

StrategyType = Literal[
    "auto", "ddp", "zero1", "zero2", "zero3", "fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-hybrid"
]
# A concrete strategy: what a plan says, never "auto".
StrategyName = Literal[
    "ddp", "zero1", "zero2", "zero3", "fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-hybrid"
]
Offload = Literal["none", "cpu", "nvme"]
Backend = Literal["auto", "fsdp", "deepspeed"]
MethodType = Literal["full", "lora", "qlora"]
Precision = Literal["bf16", "fp16", "fp32"]
OptimizerName = Literal["adamw", "adamw8bit", "sgd"]
# Structural CRD schemas cannot say "boolean or string", so checkpointing is an enum.
CheckpointingMode = Literal["auto", "none", "full"]
AttentionImpl = Literal["sdpa", "flash", "eager"]
# What the planner optimises among the configurations that fit (DESIGN §4 picks fewest GPUs).
Objective = Literal["auto", "fewest-gpus", "fastest", "lowest-cost"]
# Without checkpoint fields a job still saves this often, so it resumes and can make a final
# save on SIGTERM: a default that loses work is worse than the cost of a save per half hour.
DEFAULT_CHECKPOINT_INTERVAL_MINUTES = 30.0


def refuse_parent_segments(uri: str | None, field: str) -> str | None:
    """A storage URI must not climb out of where it points with `..` segments (checkpoint,
    output and dataset directories of one job must not reach another's). Absolute paths stay
    legal: confining them to the job's declared volumes is the volumes feature's job."""
    if uri is not None and ".." in uri.split("://", 1)[-1].split("/"):
        raise ValueError(f"{field} {uri!r} must not contain '..' path segments")
    return uri


# The CRD's CEL twin of refuse_parent_segments (api/crd.py), so the API server refuses too.
NO_PARENT_SEGMENTS_RULE = "!self.matches('(^|/)[.][.](/|$)')"


class ModelArchitecture(SpecModel):
    """Hugging Face config names, camelCased. Enough to build and plan the model."""

    model_type: str = Field(
        "llama",
        max_length=lim.MAX_SHORT_STRING,
        description="HF model_type (llama, mistral, qwen2, ...).",
    )
    hidden_size: int = Field(
        ..., ge=1, le=lim.MAX_HIDDEN_SIZE, description="Width of the residual stream."
    )
    num_hidden_layers: int = Field(
        ..., ge=1, le=lim.MAX_LAYERS, description="Number of decoder layers."
    )
    num_attention_heads: int = Field(
        ..., ge=1, le=lim.MAX_HEADS, description="Query heads per layer."
    )
    num_key_value_heads: int | None = Field(
        None,
        ge=1,
        le=lim.MAX_HEADS,
        description="Key/value heads (GQA/MQA); defaults to numAttentionHeads.",
    )
    head_dim: int | None = Field(
        None, ge=1, le=lim.MAX_HEAD_DIM, description="Per-head width; hiddenSize/heads if unset."
    )
    intermediate_size: int = Field(
        ..., ge=1, le=lim.MAX_INTERMEDIATE_SIZE, description="MLP (SwiGLU) inner width."
    )
    vocab_size: int = Field(..., ge=1, le=lim.MAX_VOCAB_SIZE, description="Vocabulary size.")
    tie_word_embeddings: bool = Field(False, description="Output head shares the input embedding.")
    max_position_embeddings: int | None = Field(
        None, ge=1, le=lim.MAX_POSITIONS, description="Longest sequence."
    )
    num_local_experts: int | None = Field(
        None, ge=1, le=lim.MAX_EXPERTS, description="MoE: experts per layer."
    )
    num_experts_per_tok: int | None = Field(
        None, ge=1, le=lim.MAX_EXPERTS, description="MoE: experts routed per token."
    )
    moe_intermediate_size: int | None = Field(
        None, ge=1, le=lim.MAX_INTERMEDIATE_SIZE, description="MoE: expert MLP width."
    )

    @model_validator(mode="after")
    def _check_heads(self) -> ModelArchitecture:
        kv = self.num_key_value_heads or self.num_attention_heads
        if self.num_attention_heads % kv:
            raise ValueError(
                f"numKeyValueHeads ({kv}) must divide numAttentionHeads "
                f"({self.num_attention_heads})"
            )
        if (self.num_local_experts is None) != (self.num_experts_per_tok is None):
            raise ValueError("numLocalExperts and numExpertsPerTok must be set together")
        return self


class ModelSpec(SpecModel):
    name: str = Field(
        ...,
        min_length=1,
        max_length=lim.MAX_MODEL_NAME_LENGTH,
        description="HF hub id, catalog name or path.",
    )
    architecture: ModelArchitecture | None = Field(
        None, description="Explicit architecture; looked up in the catalog by name when absent."
    )
    parameters: int | None = Field(
        None, ge=1, le=lim.MAX_PARAMETERS, description="Parameter count; derived if absent."
    )
    source: Literal["hub", "pvc", "uri", "inline"] = Field(
        "hub", description="Where weights come from; inline = random init from architecture."
    )
    revision: str | None = Field(
        None, max_length=lim.MAX_SHORT_STRING, description="Hub revision (branch, tag or commit)."
    )
    path: str | None = Field(
        None,
        max_length=lim.MAX_URI_LENGTH,
        description=(
            "Directory of the Hugging Face model (config.json, *.safetensors) on a mounted "
            "volume, for source pvc or uri; defaults to name. name stays the catalog/hub id."
        ),
    )
    attention: AttentionImpl = Field("sdpa", description="Attention implementation.")

    def weights_location(self) -> str | None:
        """Where pretrained weights are read from (None: inline, random init)."""
        if self.source == "inline":
            return None
        return self.path or self.name


class DatasetSpec(SpecModel):
    uri: str = Field(
        ...,
        min_length=1,
        max_length=lim.MAX_URI_LENGTH,
        description="Path, s3:// URI or HF dataset id.",
    )
    format: Literal["jsonl", "parquet", "hf"] = Field("jsonl", description="Dataset format.")
    text_field: str | None = Field(
        "text", max_length=lim.MAX_SHORT_STRING, description="Field holding raw text."
    )
    messages_field: str | None = Field(
        None, max_length=lim.MAX_SHORT_STRING, description="Field holding chat messages."
    )
    packing: bool = Field(True, description="Pack samples into full-length sequences.")

    @field_validator("uri")
    @classmethod
    def _uri_stays_put(cls, uri: str) -> str:
        return refuse_parent_segments(uri, "dataset.uri") or uri


class LoraSpec(SpecModel):
    rank: int = Field(16, ge=1, le=lim.MAX_LORA_RANK, description="LoRA rank r.")
    alpha: int = Field(
        32, ge=1, le=lim.MAX_LORA_ALPHA, description="LoRA alpha (scale = alpha / rank)."
    )
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="LoRA dropout.")
    target_modules: list[Annotated[str, StringConstraints(max_length=lim.MAX_SHORT_STRING)]] = (
        Field(
            default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
            min_length=1,
            max_length=lim.MAX_LORA_TARGETS,
            description="Module names that get adapters.",
        )
    )


class MethodSpec(SpecModel):
    type: MethodType = Field("full", description="full | lora | qlora.")
    lora: LoraSpec | None = Field(None, description="Adapter settings for lora/qlora.")

    @model_validator(mode="after")
    def _lora_only_with_adapters(self) -> MethodSpec:
        if self.type == "full" and self.lora is not None:
            raise ValueError("method.lora is set but method.type is 'full'")
        if self.type != "full" and self.lora is None:
            self.lora = LoraSpec()
        return self


class TrainingSpec(SpecModel):
    sequence_length: int = Field(
        2048, ge=8, le=lim.MAX_SEQUENCE_LENGTH, description="Tokens per sample."
    )
    global_batch_size: int = Field(
        8, ge=1, le=lim.MAX_GLOBAL_BATCH, description="Samples per optimizer step, all ranks."
    )
    micro_batch_size: int | Literal["auto"] = Field(
        "auto", description="Samples per rank per forward; auto lets the planner pick."
    )
    max_steps: int | None = Field(
        None, ge=1, le=lim.MAX_STEPS, description="Optimizer steps to run."
    )
    epochs: float | None = Field(
        None, gt=0, le=lim.MAX_EPOCHS, description="Epochs, when maxSteps is unset."
    )
    learning_rate: float = Field(
        2e-5, gt=0, le=lim.MAX_LEARNING_RATE, description="Peak learning rate."
    )
    warmup_steps: int = Field(0, ge=0, le=lim.MAX_STEPS, description="Linear warm-up steps.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="LR decay.")
    weight_decay: float = Field(
        0.0, ge=0, le=lim.MAX_WEIGHT_DECAY, description="AdamW weight decay."
    )
    max_grad_norm: float = Field(
        1.0, ge=0, le=lim.MAX_GRAD_NORM, description="Gradient clipping norm (0 = off)."
    )
    precision: Precision = Field("bf16", description="Compute precision.")
    optimizer: OptimizerName = Field("adamw", description="Optimizer.")
    gradient_checkpointing: CheckpointingMode = Field(
        "auto", description="Activation checkpointing: auto (planner decides), none or full."
    )
    seed: int = Field(42, ge=0, le=lim.MAX_SEED, description="Random seed.")

    @model_validator(mode="after")
    def _check(self) -> TrainingSpec:
        mb = self.micro_batch_size
        if isinstance(mb, int) and not 1 <= mb <= lim.MAX_MICRO_BATCH:
            raise ValueError(f"training.microBatchSize must be 1..{lim.MAX_MICRO_BATCH} or 'auto'")
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set training.maxSteps or training.epochs")
        if self.warmup_steps and self.max_steps and self.warmup_steps > self.max_steps:
            raise ValueError("training.warmupSteps must not exceed training.maxSteps")
        return self


class GpuSpec(SpecModel):
    resource_name: str = Field(
        "nvidia.com/gpu",
        max_length=lim.MAX_NAME_LENGTH,
        description="Extended resource to request.",
    )
    product: str | None = Field(
        None,
        max_length=lim.MAX_SHORT_STRING,
        description="GPU product, e.g. H100-80GB, A100-40GB, L4.",
    )
    memory_gib: float | None = Field(
        None,
        gt=0,
        le=lim.MAX_GPU_MEMORY_GIB,
        alias="memoryGiB",
        description="GPU memory; from product if unset.",
    )


class LocalObjectReference(SpecModel):
    name: str = Field(..., min_length=1, max_length=lim.MAX_NAME_LENGTH)


class ResourcesSpec(SpecModel):
    device: Literal["gpu", "cpu"] = Field(
        "gpu", description="gpu, or cpu for CPU-only (gloo) runs such as the local quickstart."
    )
    gpu: GpuSpec = Field(default_factory=GpuSpec, description="Accelerator per process.")
    gpus_per_node: int = Field(
        1, ge=1, le=lim.MAX_GPUS_PER_NODE, description="Processes (GPUs) per worker pod."
    )
    max_gpus: int | None = Field(
        None, ge=1, le=lim.MAX_GPUS, alias="maxGPUs", description="Upper bound on the world size."
    )
    min_nodes: int | None = Field(
        None, ge=1, le=lim.MAX_NODES, description="Elastic minimum of worker pods."
    )
    max_nodes: int | None = Field(
        None, ge=1, le=lim.MAX_NODES, description="Elastic maximum of worker pods."
    )
    cpu: str | None = Field(
        None,
        max_length=lim.MAX_SHORT_STRING,
        description="CPU request/limit per worker pod, e.g. '8'.",
    )
    memory: str | None = Field(
        None,
        max_length=lim.MAX_SHORT_STRING,
        description="Memory request/limit per worker pod, e.g. 64Gi.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=lim.MAX_LIST_ITEMS, description="Worker nodeSelector."
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, max_length=lim.MAX_LIST_ITEMS, description="Tolerations."
    )
    objective: Objective = Field(
        "auto",
        description=(
            "What the planner optimises among plans that fit: fewest-gpus, fastest (shortest "
            "step time within maxGPUs), lowest-cost (fewest GPU-hours). auto: fastest when "
            "maxGPUs is set (you said what you will spend), else fewest-gpus."
        ),
    )
    affinity: dict[str, Any] | None = Field(None, description="Extra pod affinity.")
    priority_class_name: str | None = Field(
        None, max_length=lim.MAX_NAME_LENGTH, description="PriorityClass of worker pods."
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=lim.MAX_LIST_ITEMS
    )
    service_account_name: str | None = Field(
        None,
        max_length=lim.MAX_NAME_LENGTH,
        description="ServiceAccount of the pods; default: the operator's trainer ServiceAccount. "
        "Must be one the operator allows (chart value policy.allowedServiceAccounts).",
    )
    automount_service_account_token: bool = Field(
        False,
        description="Mount the ServiceAccount's API token into the pods. Off: trainers never "
        "talk to the Kubernetes API, so a compromised trainer gets no credentials.",
    )

    @model_validator(mode="after")
    def _check_nodes(self) -> ResourcesSpec:
        if self.min_nodes and self.max_nodes and self.min_nodes > self.max_nodes:
            raise ValueError(
                f"resources.minNodes ({self.min_nodes}) must be <= "
                f"resources.maxNodes ({self.max_nodes})"
            )
        return self


class StrategySpec(SpecModel):
    type: StrategyType = Field("auto", description="auto (planner decides) or a pinned strategy.")
    offload: Offload = Field("none", description="Offload of optimizer states/parameters.")
    backend: Backend = Field("auto", description="auto | fsdp | deepspeed.")
    deepspeed_config: dict[str, Any] | None = Field(
        None,
        description=(
            "Your own DeepSpeed config keys (a JSON object, as in a ds_config.json), merged into "
            "the config the trainer generates from the plan. The plan wins where they disagree "
            "(batch sizes, zero_optimization.stage, offload devices, bf16/fp16, "
            "gradient_clipping, bucket sizes); optimizer, scheduler, amp, torch_autocast, "
            "checkpoint and elasticity come from the spec and are dropped. The trainer logs "
            "every key it overrode. Needs backend deepspeed (or type zero1/zero2)."
        ),
    )

    @model_validator(mode="after")
    def _check_backend(self) -> StrategySpec:
        if self.type in ("zero1", "zero2") and self.backend == "fsdp":
            raise ValueError(f"strategy.type {self.type} needs backend deepspeed, not fsdp")
        if self.type.startswith("fsdp") and self.backend == "deepspeed":
            raise ValueError(f"strategy.type {self.type} needs backend fsdp, not deepspeed")
        if self.deepspeed_config is not None:
            if self.backend != "deepspeed" and self.type not in ("zero1", "zero2"):
                raise ValueError(
                    "strategy.deepspeedConfig needs strategy.backend deepspeed "
                    f"(backend is {self.backend}, type {self.type})"
                )
            size = len(json.dumps(self.deepspeed_config))
            if size > lim.MAX_DEEPSPEED_CONFIG_BYTES:
                raise ValueError(
                    f"strategy.deepspeedConfig is {size} bytes as JSON; at most "
                    f"{lim.MAX_DEEPSPEED_CONFIG_BYTES}"
                )
        return self


class CheckpointSpec(SpecModel):
    uri: str = Field(
        "checkpoints",
        min_length=1,
        max_length=lim.MAX_URI_LENGTH,
        description="Directory (or s3:// URI) for checkpoints.",
    )
    interval_steps: int | None = Field(
        None, ge=1, le=lim.MAX_STEPS, description="Save every N steps."
    )
    interval_minutes: float | None = Field(
        DEFAULT_CHECKPOINT_INTERVAL_MINUTES,
        gt=0,
        le=lim.MAX_INTERVAL_MINUTES,
        description="Save every N minutes (also when intervalSteps is set: whichever comes first).",
    )
    keep: int = Field(
        3, ge=1, le=lim.MAX_CHECKPOINTS_KEPT, description="Committed checkpoints to keep."
    )
    enabled: bool = Field(
        True, description="false: never checkpoint (no resume, no final save on SIGTERM)."
    )
    async_: bool = Field(True, alias="async", description="Save in the background (DCP async).")

    @field_validator("uri")
    @classmethod
    def _uri_stays_put(cls, uri: str) -> str:
        return refuse_parent_segments(uri, "checkpoint.uri") or uri


class StragglerSpec(SpecModel):
    enabled: bool = Field(True, description="Detect stragglers.")
    action: Literal["evict", "alert"] = Field("evict", description="evict or only alert.")
    threshold: float = Field(
        1.2,
        gt=1.0,
        le=lim.MAX_STRAGGLER_THRESHOLD,
        description="Compute-time ratio over the median.",
    )
    window_steps: int = Field(
        20, ge=1, le=lim.MAX_WINDOW_STEPS, description="Steps per detection window."
    )
    consecutive_windows: int = Field(
        3, ge=1, le=lim.MAX_CONSECUTIVE_WINDOWS, description="Windows in a row before acting."
    )
    cooldown_seconds: int = Field(
        600, ge=0, le=lim.MAX_COOLDOWN_SECONDS, description="Minimum time between evictions."
    )
    max_evictions_per_hour: int = Field(
        2, ge=0, le=lim.MAX_EVICTIONS_PER_HOUR, description="Eviction rate limit."
    )


class FaultToleranceSpec(SpecModel):
    max_restarts: int = Field(
        3, ge=0, le=lim.MAX_RESTARTS, description="Worker replacements before Failed."
    )
    backoff_seconds: float = Field(
        10, ge=0, le=lim.MAX_BACKOFF_SECONDS, description="Base delay before a replacement."
    )
    hang_timeout_seconds: int = Field(
        600,
        ge=10,
        le=86400,
        description=(
            "No step progress on any rank, or a rank whose heartbeat is older than this, for "
            "this long is a hang: the workers restart from the last committed checkpoint "
            "(counted against maxRestarts)."
        ),
    )
    stragglers: StragglerSpec = Field(default_factory=StragglerSpec)


class OutputSpec(SpecModel):
    uri: str | None = Field(
        None, max_length=lim.MAX_URI_LENGTH, description="Where the final model is written."
    )
    format: Literal["hf-safetensors"] = Field("hf-safetensors", description="Output format.")
    merge_lora: bool = Field(False, description="Merge adapters into the base weights.")

    @field_validator("uri")
    @classmethod
    def _uri_stays_put(cls, uri: str | None) -> str | None:
        return refuse_parent_segments(uri, "output.uri")


class FineTuneJobSpec(SpecModel):
    model: ModelSpec = Field(..., description="The model to fine-tune.")
    dataset: DatasetSpec = Field(..., description="The training data.")
    method: MethodSpec = Field(default_factory=MethodSpec, description="full, lora or qlora.")
    training: TrainingSpec = Field(..., description="Sequence, batch, steps, optimizer, precision.")
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="GPUs, nodes and pod scheduling."
    )
    strategy: StrategySpec = Field(
        default_factory=StrategySpec, description="Sharding strategy (auto: the planner picks)."
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec, description="Where and how often to checkpoint."
    )
    fault_tolerance: FaultToleranceSpec = Field(
        default_factory=FaultToleranceSpec, description="Restarts, backoff and stragglers."
    )
    output: OutputSpec = Field(default_factory=OutputSpec, description="The trained model.")
    storage: StorageSpec = Field(
        default_factory=StorageSpec,
        description="Volumes mounted into every worker: checkpoints, output, data, weights.",
    )
    image: str | None = Field(
        None,
        min_length=1,
        max_length=lim.MAX_IMAGE_LENGTH,
        description="Trainer image; default: the operator's (chart value trainer.image). "
        "Must match the operator's allowed images (chart value policy.allowedImages).",
    )
    suspend: bool = Field(False, description="Delete pods, keep checkpoints; false resumes.")
