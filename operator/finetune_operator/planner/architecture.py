"""Resolve a ModelSpec to an architecture and count its parameters as the HF modules do.

Counting is by shape, per module, so that LoRA, QLoRA and FSDP-unit sizes can be derived from
the same numbers. The family table lists what a `model_type` adds over the Llama layout; the
catalog test builds every catalog model on the meta device and checks the count is exact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from finetune_operator.api.spec import ModelArchitecture, ModelSpec
from finetune_operator.planner.catalog import lookup
from finetune_operator.planner.errors import PlanningError


@dataclass(frozen=True)
class Family:
    """What a model_type adds to the Llama decoder layout (all read from HF modeling code)."""

    qkv_bias: bool = False  # Qwen2: q/k/v projections have biases, o_proj has none.
    qk_norm: bool = False  # Qwen3, Gemma-3: RMSNorm(head_dim) on queries and keys.
    norms_per_layer: int = 2  # Gemma-2/3 add post-attention and post-feedforward norms.
    logit_softcap: bool = False  # Gemma-2: tanh soft-capping of the logits (extra bsV tensors).


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "mixtral": Family(),
    "phi3": Family(),  # fused qkv_proj / gate_up_proj: same parameter count.
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "qwen3_moe": Family(qk_norm=True),
    "gemma": Family(),
    "gemma2": Family(norms_per_layer=4, logit_softcap=True),
    "gemma3_text": Family(norms_per_layer=4, qk_norm=True),
}
# Unknown model types are planned as Llama-like; their parameter count may miss family extras.
DEFAULT_FAMILY = Family()

# Linear modules of a decoder layer by the names PEFT's targetModules use.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """An architecture with its derived sizes and exact parameter counts."""

    arch: ModelArchitecture
    family: Family
    head_dim: int
    q_dim: int  # numAttentionHeads * headDim (may differ from hiddenSize: Qwen3, Gemma)
    kv_dim: int  # numKeyValueHeads * headDim
    experts: int  # 0 for dense models
    experts_active: int
    expert_inter: int  # MLP width of one expert (or of the dense MLP)
    embedding: int
    lm_head: int  # 0 when tied
    layer: int  # parameters of one decoder layer
    layer_linear: int  # of those, in nn.Linear weights (what QLoRA quantises)
    layer_active: int  # per-token active parameters of one layer (MoE: k experts)
    total: int
    active: int

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each named linear of one layer (one expert for MoE)."""
        h, i = self.arch.hidden_size, self.expert_inter
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def largest_linear(self) -> int:
        return max(a * b for a, b in self.linear_shapes().values())


def shape_of(arch: ModelArchitecture) -> ModelShape:
    """Count parameters exactly as `AutoModelForCausalLM.from_config` would build them."""
    fam = FAMILIES.get(arch.model_type, DEFAULT_FAMILY)
    h, v = arch.hidden_size, arch.vocab_size
    head_dim = arch.head_dim or h // arch.num_attention_heads
    q_dim = arch.num_attention_heads * head_dim
    kv_dim = (arch.num_key_value_heads or arch.num_attention_heads) * head_dim
    experts = arch.num_local_experts or 0
    k = arch.num_experts_per_tok or 0
    inter = (
        arch.moe_intermediate_size
        if experts and arch.moe_intermediate_size
        else (arch.intermediate_size)
    )
    attn_linear = h * q_dim + 2 * h * kv_dim + q_dim * h
    attn_extra = (q_dim + 2 * kv_dim if fam.qkv_bias else 0) + (2 * head_dim if fam.qk_norm else 0)
    mlp_one = 3 * h * inter
    norms = fam.norms_per_layer * h
    if experts:
        router = h * experts  # nn.Linear(hidden, experts, bias=False)
        layer_linear = attn_linear + experts * mlp_one
        layer = layer_linear + router + attn_extra + norms
        layer_active = attn_linear + k * mlp_one + router + attn_extra + norms
    else:
        layer_linear = attn_linear + mlp_one
        layer = layer_active = layer_linear + attn_extra + norms
    embedding = v * h
    lm_head = 0 if arch.tie_word_embeddings else v * h
    total = embedding + lm_head + h + arch.num_hidden_layers * layer
    active = embedding + lm_head + h + arch.num_hidden_layers * layer_active
    return ModelShape(
        arch=arch,
        family=fam,
        head_dim=head_dim,
        q_dim=q_dim,
        kv_dim=kv_dim,
        experts=experts,
        experts_active=k,
        expert_inter=inter,
        embedding=embedding,
        lm_head=lm_head,
        layer=layer,
        layer_linear=layer_linear,
        layer_active=layer_active,
        total=total,
        active=active,
    )


# HF config.json keys that differ from ModelArchitecture's snake_case field names.
_CONFIG_RENAMES = {"num_experts": "num_local_experts"}


def architecture_from_config(config: dict[str, Any]) -> ModelArchitecture:
    """Map an HF config.json dict (multimodal configs: their text_config) to our fields."""
    if isinstance(config.get("text_config"), dict):
        config = {
            **config["text_config"],
            "model_type": config["text_config"].get(
                "model_type", config.get("model_type", "llama")
            ),
        }
    fields = ModelArchitecture.model_fields
    values = {_CONFIG_RENAMES.get(k, k): v for k, v in config.items()}
    picked = {k: v for k, v in values.items() if k in fields and v is not None}
    if not picked.get("moe_intermediate_size") or not picked.get("num_local_experts"):
        picked.pop("moe_intermediate_size", None)
    return ModelArchitecture.model_validate(picked)


def _from_path(name: str) -> ModelArchitecture | None:
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        return None
    try:
        return architecture_from_config(json.loads(path.read_text()))
    except (OSError, ValueError, ValidationError) as exc:
        raise PlanningError(
            "spec.model.name", f"cannot read a model config from {path}: {exc}"
        ) from exc


def resolve_model(model: ModelSpec) -> ModelShape:
    """Explicit architecture first, then the catalog by name, then a config.json path."""
    arch = model.architecture
    if arch is None:
        entry = lookup(model.name)
        arch = entry.architecture if entry else _from_path(model.path or model.name)
    if arch is None and "://" in (model.path or model.name):
        # The operator holds no object-store credentials: it never reads the bucket.
        raise PlanningError(
            "spec.model.architecture",
            f"model {model.name!r} is not in the planner's catalog and the operator does not "
            f"read {model.path or model.name}: name a catalog model in spec.model.name, or "
            "set spec.model.architecture (hiddenSize, numHiddenLayers, ...)",
        )
    if arch is None:
        raise PlanningError(
            "spec.model.architecture",
            f"model {model.name!r} is not in the planner's catalog and is not a path to a "
            "config.json: set spec.model.architecture (hiddenSize, numHiddenLayers, ...)",
        )
    return shape_of(arch)
