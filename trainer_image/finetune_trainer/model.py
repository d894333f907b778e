"""The model: built from an inline architecture or loaded with `from_pretrained`, with LoRA
adapters when the method asks for them.

Dtypes are what the planner assumes (finetune_operator.planner.memory): full fine-tuning keeps
fp32 master weights in every precision (bf16 compute comes from the strategy: FSDP2's
MixedPrecisionPolicy or DDP's autocast); LoRA/QLoRA with bf16 freeze a bf16 base, as real
stacks load it, and peft keeps the adapters in fp32 (`autocast_adapter_dtype=True`)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from finetune_operator.api.spec import MethodSpec, ModelArchitecture, ModelSpec, Precision
from finetune_trainer.errors import UnsupportedConfigError

log = logging.getLogger(__name__)

_ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flash": "flash_attention_2"}


def hf_config_kwargs(arch: ModelArchitecture) -> dict[str, Any]:
    """The Hugging Face config keys of an inline architecture (unset ones left to defaults)."""
    raw = arch.model_dump(exclude_none=True, by_alias=False)
    raw.pop("model_type", None)
    return raw


def _attention(spec: ModelSpec, device: torch.device) -> str:
    if spec.attention == "flash" and device.type != "cuda":
        raise UnsupportedConfigError(
            "model.attention 'flash' needs a CUDA GPU; use 'sdpa' or 'eager' on CPU"
        )
    return _ATTENTION[spec.attention]


def base_dtype(method: MethodSpec, precision: Precision) -> torch.dtype:
    """dtype of the base weights: a frozen LoRA/QLoRA base is bf16 under bf16; everything
    else (full fine-tuning's master weights, fp32 runs) is fp32."""
    if method.type in ("lora", "qlora") and precision == "bf16":
        return torch.bfloat16
    return torch.float32


def _load_base(
    spec: ModelSpec,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    method: MethodSpec,
    dtype: torch.dtype,
) -> nn.Module:
    attn = _attention(spec, device)
    if spec.source == "inline":
        if spec.architecture is None:
            raise UnsupportedConfigError("model.source 'inline' needs model.architecture")
        config = AutoConfig.for_model(
            spec.architecture.model_type,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **hf_config_kwargs(spec.architecture),
        )
        # Every rank seeds identically before this call, so FSDP shards one shared init. The
        # init runs in fp32 and a bf16 base is cast afterwards (the same weights, rounded).
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        return model.to(dtype) if dtype != torch.float32 else model
    # dtype explicitly: transformers 5 defaults to "auto" (the checkpoint's own dtype, often
    # bf16), which would silently drop full fine-tuning's fp32 master weights.
    kwargs: dict[str, Any] = {
        "revision": spec.revision,
        "attn_implementation": attn,
        "dtype": dtype,
    }
    if method.type == "qlora":
        kwargs["quantization_config"] = _qlora_config()
        kwargs["device_map"] = {"": device}
    return AutoModelForCausalLM.from_pretrained(spec.name, **kwargs)


def _qlora_config() -> Any:
    try:
        from transformers import BitsAndBytesConfig
    except ImportError as e:  # pragma: no cover - transformers always has it
        raise UnsupportedConfigError("method.type qlora needs bitsandbytes") from e
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def _add_lora(model: nn.Module, method: MethodSpec) -> nn.Module:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    assert method.lora is not None  # MethodSpec fills it for lora/qlora
    if method.type == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = LoraConfig(
        r=method.lora.rank,
        lora_alpha=method.lora.alpha,
        lora_dropout=method.lora.dropout,
        target_modules=list(method.lora.target_modules),
        task_type="CAUSAL_LM",
    )
    # autocast_adapter_dtype (peft's default): adapters over a bf16 base are created in fp32,
    # their own master weights.
    return get_peft_model(model, config, autocast_adapter_dtype=True)  # type: ignore[arg-type]


def build_model(
    spec: ModelSpec,
    method: MethodSpec,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    *,
    activation_checkpointing: bool,
    precision: Precision,
) -> nn.Module:
    """Build on the training device in the dtypes `precision` asks for (see the module
    docstring); wrapping for a strategy happens later (parallelize)."""
    if method.type == "qlora" and device.type != "cuda":
        raise UnsupportedConfigError(
            "method.type qlora needs a CUDA GPU (bitsandbytes 4-bit weights); "
            "use method.type lora on CPU"
        )
    # A random init (inline) runs on the GPU itself: an 8B model's CPU init takes minutes.
    # Its fp32 transient is released and the peaks reset before training (Trainer).
    on_device = spec.source == "inline" and device.type == "cuda"
    with torch.device(device) if on_device else contextlib.nullcontext():
        model = _load_base(spec, tokenizer, device, method, base_dtype(method, precision))
    if method.type != "qlora":
        model = model.to(device)
    if activation_checkpointing:
        # Non-reentrant: composes with FSDP2 and with frozen (LoRA) base weights.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method.type in ("lora", "qlora"):
        model = _add_lora(model, method)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("model %s: %d parameters, %d trainable", spec.name, total, trainable)
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, found by the class names HF lists in `_no_split_modules`."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]
