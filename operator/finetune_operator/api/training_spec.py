"""What the model is trained on and how: `spec.dataset`, `spec.method`, `spec.training`."""

from __future__ import annotations

import warnings
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from finetune_operator.api import limits as lim
from finetune_operator.api.base import SpecModel
from finetune_operator.api.quantity import quantity_bytes
from finetune_operator.api.resources_spec import Quantity
from finetune_operator.api.spec_types import (
    ActivationCheckpointingMode,
    MethodType,
    OptimizerName,
    Precision,
    refuse_parent_segments,
)

DEFAULT_CACHE_SIZE_LIMIT = "32Gi"
MIN_CACHE_SIZE_LIMIT = "64Mi"


class DatasetSpec(SpecModel):
    uri: str = Field(
        ...,
        min_length=1,
        max_length=lim.MAX_URI_LENGTH,
        description="A file (jsonl/parquet) or directory on a volume of spec.storage, "
        "s3://bucket/key (jsonl/parquet objects, a * glob in the last part; fetched once per "
        "pod into its data-cache volume), a Hugging Face dataset id (format hf), or "
        "builtin://quickstart.",
    )
    format: Literal["jsonl", "parquet", "hf"] = Field("jsonl", description="Dataset format.")
    text_field: str | None = Field(
        "text", max_length=lim.MAX_SHORT_STRING, description="Field holding raw text."
    )
    messages_field: str | None = Field(
        None, max_length=lim.MAX_SHORT_STRING, description="Field holding chat messages."
    )
    packing: bool = Field(True, description="Pack samples into full-length sequences.")
    cache_size_limit: Quantity = Field(
        DEFAULT_CACHE_SIZE_LIMIT,
        description=(
            "Size of each worker's data-cache volume (an emptyDir sizeLimit, also requested as "
            "ephemeral-storage so the pod lands on a node with that much disk): the tokenized "
            "blocks take 2 bytes a token (4 for vocabularies over 65,536 ids); blocks that do "
            f"not fit are tokenized in memory by every rank instead. At least {MIN_CACHE_SIZE_LIMIT}."
        ),
    )

    @field_validator("uri")
    @classmethod
    def _uri_stays_put(cls, uri: str) -> str:
        return refuse_parent_segments(uri, "dataset.uri") or uri

    @field_validator("cache_size_limit")
    @classmethod
    def _cache_size(cls, text: str) -> str:
        if quantity_bytes(text, "dataset.cacheSizeLimit") < quantity_bytes(
            MIN_CACHE_SIZE_LIMIT, ""
        ):
            raise ValueError(f"dataset.cacheSizeLimit {text!r} is below {MIN_CACHE_SIZE_LIMIT}")
        return text

    @property
    def cache_size_limit_bytes(self) -> int:
        return quantity_bytes(self.cache_size_limit, "dataset.cacheSizeLimit")


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
    activation_checkpointing: ActivationCheckpointingMode = Field(
        "auto",
        description="Activation checkpointing (recompute activations in backward): auto "
        "(planner decides), none or full.",
    )
    # The field's old name: still accepted (existing manifests, and kubectl's strict
    # validation needs it in the schema), moved to activationCheckpointing with a warning.
    gradient_checkpointing: ActivationCheckpointingMode | None = Field(
        None, description="Deprecated: the old name of activationCheckpointing."
    )
    seed: int = Field(42, ge=0, le=lim.MAX_SEED, description="Random seed.")

    @model_validator(mode="after")
    def _old_checkpointing_name(self) -> TrainingSpec:
        old = self.gradient_checkpointing
        if old is None:
            return self
        # "auto" is the new field's default, which the API server fills in on an old manifest.
        if self.activation_checkpointing not in ("auto", old):
            raise ValueError(
                "training.gradientCheckpointing is the deprecated name of "
                "training.activationCheckpointing: set only activationCheckpointing"
            )
        warnings.warn(
            "training.gradientCheckpointing is deprecated: use training.activationCheckpointing",
            FutureWarning,
            stacklevel=2,
        )
        self.activation_checkpointing, self.gradient_checkpointing = old, None
        return self

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
