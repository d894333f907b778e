"""The model: built from an inline architecture or loaded with `from_pretrained`, with LoRA
adapters when the method asks for them."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from finetune_operator.api.spec import MethodSpec, ModelArchitecture, ModelSpec
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


def _load_base(
    spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, device: torch.device, method: MethodSpec
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
        # Every rank seeds identically before this call, so FSDP shards one shared init.
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    kwargs: dict[str, Any] = {"revision": spec.revision, "attn_implementation": attn}
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
    return get_peft_model(model, config)  # type: ignore[arg-type]


def build_model(
    spec: ModelSpec,
    method: MethodSpec,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    *,
    activation_checkpointing: bool,
) -> nn.Module:
    """Build on the training device; wrapping for a strategy happens later (parallelize)."""
    if method.type == "qlora" and device.type != "cuda":
        raise UnsupportedConfigError(
            "method.type qlora needs a CUDA GPU (bitsandbytes 4-bit weights); "
            "use method.type lora on CPU"
        )
    model = _load_base(spec, tokenizer, device, method)
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
