"""`spec.model`: which model to fine-tune (a catalog name, a path, or an inline architecture)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from finetune_operator.api import limits as lim
from finetune_operator.api.base import SpecModel
from finetune_operator.api.spec_types import (
    AttentionImpl,
)


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
            "volume, for source pvc or uri, or s3://bucket/prefix for source uri (weights "
            "read by byte ranges into each rank's shards); defaults to name. name stays the "
            "catalog/hub id."
        ),
    )
    attention: AttentionImpl = Field("sdpa", description="Attention implementation.")

    def weights_location(self) -> str | None:
        """Where pretrained weights are read from (None: inline, random init)."""
        if self.source == "inline":
            return None
        return self.path or self.name
