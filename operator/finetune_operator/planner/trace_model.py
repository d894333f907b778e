"""What the tracer traces: the configuration, and the Hugging Face model built from it on the
meta device, with adapters, checkpointing and FSDP2 sharding as the trainer applies them.

torch and transformers are imported inside functions only (see planner/trace.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from finetune_operator.api.spec import LoraSpec, ModelArchitecture

TraceStrategy = Literal["ddp", "fsdp-full-shard", "zero3", "fsdp-shard-grad-op"]
# bf16-mixed: fp32 master params, bf16 compute (FSDP MixedPrecisionPolicy, DDP autocast);
# bf16-pure: params, grads and AdamW states all bf16; fp32: everything fp32.
TracePrecision = Literal["bf16-mixed", "bf16-pure", "fp32"]

SHARDED: frozenset[str] = frozenset({"fsdp-full-shard", "zero3", "fsdp-shard-grad-op"})


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    """One configuration to trace; every field is a knob of the real step."""

    arch: ModelArchitecture
    method: Literal["full", "lora"] = "full"
    lora: LoraSpec | None = None
    strategy: TraceStrategy = "ddp"
    world_size: int = 1
    micro_batch_size: int = 1
    seq_len: int = 2048
    checkpointing: bool = False
    precision: TracePrecision = "bf16-mixed"
    ddp_bucket_view: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in ("ddp", *SHARDED):
            raise ValueError(f"strategy {self.strategy!r} cannot be traced (ddp or fsdp/zero3)")
        if (
            self.arch.num_local_experts
            and self.strategy == "ddp"
            and self.precision == "bf16-mixed"
        ):
            # grouped_mm wants bf16 operands and CPU autocast does not cast them.
            raise ValueError("MoE with DDP bf16-mixed cannot be traced on CPU; use bf16-pure")
        if self.world_size < 1 or self.micro_batch_size < 1 or self.seq_len < 1:
            raise ValueError("world_size, micro_batch_size and seq_len must be >= 1")

    @property
    def sharded(self) -> bool:
        return self.strategy in SHARDED


def hf_config(arch: ModelArchitecture) -> Any:
    """The transformers config of ``arch`` (no cache: a training step)."""
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {
        "hidden_size": arch.hidden_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads or arch.num_attention_heads,
        "intermediate_size": arch.intermediate_size,
        "vocab_size": arch.vocab_size,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "use_cache": False,
    }
    if arch.head_dim is not None:
        kwargs["head_dim"] = arch.head_dim
    if arch.max_position_embeddings is not None:
        kwargs["max_position_embeddings"] = arch.max_position_embeddings
    if arch.num_local_experts is not None:
        # Mixtral calls them local experts, Qwen-MoE just experts.
        key = "num_local_experts" if arch.model_type == "mixtral" else "num_experts"
        kwargs[key] = arch.num_local_experts
        kwargs["num_experts_per_tok"] = arch.num_experts_per_tok
    if arch.moe_intermediate_size is not None:
        kwargs["moe_intermediate_size"] = arch.moe_intermediate_size
    return AutoConfig.for_model(arch.model_type, **kwargs)


def build_model(config: TraceConfig, notes: list[str]) -> Any:
    """The model on the meta device, with adapters and checkpointing, not yet wrapped."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = hf_config(config.arch)
    auto: Any = AutoModelForCausalLM  # untyped classmethods
    extra: dict[str, Any] = {"attn_implementation": "sdpa"}
    if config.arch.num_local_experts is not None:
        # The data-dependent eager expert loop cannot run on fake tensors; grouped_mm is the
        # GPU path anyway.
        extra["experts_implementation"] = "grouped_mm"
    with torch.device("meta"):
        try:
            model = auto.from_config(hf, **extra)
        except ValueError as err:  # e.g. soft-capped attention refuses sdpa
            notes.append(f"sdpa refused ({err}); eager attention materialises s² scores")
            extra["attn_implementation"] = "eager"
            model = auto.from_config(hf, **extra)
    if config.checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if config.method == "lora":
        from peft import LoraConfig, get_peft_model

        spec = config.lora or LoraSpec()
        lcfg = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            lora_dropout=spec.dropout,
            target_modules=list(spec.target_modules),
        )
        # peft keeps adapters in fp32 over a bf16 base (autocast_adapter_dtype), as on a GPU.
        model = get_peft_model(model, lcfg)
    model.train()
    return model


def base_model(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def wrap(config: TraceConfig, model: Any, notes: list[str]) -> Any:
    """Shard with FSDP2 for the sharded strategies; the order (layers, then root) is FSDP2's."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not config.sharded:
        return model
    mesh = init_device_mesh("cpu", (config.world_size,))
    reshard = config.strategy != "fsdp-shard-grad-op"
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard}
    if config.precision == "bf16-mixed":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in base_model(model).model.layers:
        fully_shard(layer, **kwargs)
    # The root (embeddings, norm, head) is never resharded after forward, as the trainer does
    # (finetune_trainer.parallelize): backward re-gathers it at once.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    notes.append(f"FSDP2 per decoder layer (reshard_after_forward={reshard}) + root (False)")
    return model
