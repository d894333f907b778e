"""The model: built on the meta device from one config (the pretrained weights' config.json,
or the architecture the planner resolved for inline models), with LoRA adapters when the
method asks for them; sharded, then materialised (finetune_trainer.materialize), so no rank
ever holds more than its shards plus one module (DESIGN.md §6, loading at scale).

Dtypes are what the planner assumes (finetune_operator.planner.memory): full fine-tuning keeps
fp32 master weights in every precision (bf16 compute comes from the strategy: FSDP2's
MixedPrecisionPolicy or DDP's autocast); LoRA/QLoRA with bf16 freeze a bf16 base, as real
stacks load it, and peft keeps the adapters in fp32 (`autocast_adapter_dtype=True`)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from finetune_operator.api.spec import MethodSpec, ModelArchitecture, ModelSpec, Precision
from finetune_operator.api.storage import ObjectStoreSpec
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.hub_snapshot import download_snapshot
from finetune_trainer.location import Location, locate
from finetune_trainer.materialize import materialize
from finetune_trainer.remote_model import model_files, remote_weights, weights_field
from finetune_trainer.remote_tensors import from_pretrained_lazy

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
    """dtype of the base weights: a frozen LoRA/QLoRA base is bf16 under bf16 and fp16 under
    fp16 (what the planner counts: e bytes per frozen weight); everything else (full
    fine-tuning's master weights, fp32 runs) is fp32."""
    if method.type in ("lora", "qlora") and precision in ("bf16", "fp16"):
        return torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.float32


def weights_dir(
    spec: ModelSpec, object_store: ObjectStoreSpec | None = None, cache_dir: Path | None = None
) -> Path | None:
    """Where a pretrained model's config (and, but for object storage, safetensors) are: a
    directory (source pvc/uri, or a hub id already on disk), the config and tokenizer files
    fetched from an s3:// prefix (remote_model, into `cache_dir`: the pod's data cache), else
    the hub snapshot (downloaded by every rank into its own cache; no weights for inline
    models)."""
    location = spec.weights_location()
    if location is None:
        return None
    remote = remote_weights(spec, object_store)
    if remote is not None:
        return model_files(remote, weights_field(spec), cache_dir)
    path = Path(location.removeprefix("file://"))
    if path.is_dir():
        return path
    if spec.source != "hub":
        field = weights_field(spec)
        raise UnsupportedConfigError(
            f"{field} {location!r}: no such directory (source {spec.source} reads a Hugging "
            "Face model directory on a mounted volume)"
        )
    return download_snapshot(spec.name, spec.revision)


def weights_source(
    spec: ModelSpec, object_store: ObjectStoreSpec | None = None
) -> Path | Location | None:
    """Where the safetensors are read from: the object-store prefix itself (read by ranges
    into the shards, never downloaded), else the weights directory."""
    return remote_weights(spec, object_store) or weights_dir(spec)


def model_config(
    spec: ModelSpec,
    tokenizer: PreTrainedTokenizerBase,
    architecture: ModelArchitecture | None,
    object_store: ObjectStoreSpec | None = None,
    cache_dir: Path | None = None,
) -> PretrainedConfig:
    """The config to build: the weights' own config.json for pretrained models, else the
    architecture the planner resolved (spec, catalog or config.json: `Plan.architecture`)."""
    weights = weights_dir(spec, object_store, cache_dir)
    if weights is not None:
        config: PretrainedConfig = AutoConfig.from_pretrained(weights)
        return config
    if architecture is None:
        raise UnsupportedConfigError(
            "model.source 'inline' needs model.architecture (or a catalog model name)"
        )
    return AutoConfig.for_model(
        architecture.model_type,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **hf_config_kwargs(architecture),
    )


def _load_qlora_base(
    spec: ModelSpec, device: torch.device, object_store: ObjectStoreSpec | None = None
) -> nn.Module:
    # bitsandbytes quantises while loading: the one path that still loads with transformers'
    # from_pretrained, from lazy tensors (QLoRA runs replicated, DDP only, so every rank
    # holds the 4-bit base).
    options: dict[str, Any] = {
        "attn_implementation": _attention(spec, device),
        "dtype": torch.bfloat16,
        "quantization_config": _qlora_config(),
        "device_map": {"": device},
    }
    remote = remote_weights(spec, object_store)
    if remote is not None:
        # From s3://: the config fetched, the safetensors read by ranges one tensor at a
        # time as transformers quantises them (remote_tensors); every rank reads the model
        # once (each quantises its own replica: bitsandbytes' 4-bit state is per device).
        config = AutoConfig.from_pretrained(model_files(remote, weights_field(spec)))
        return from_pretrained_lazy(remote, config, **options)
    local = weights_dir(spec)
    if local is None:
        raise UnsupportedConfigError(
            "method.type qlora quantises pretrained weights: model.source inline has none"
        )
    # A directory (or the hub's snapshot) through the same reader, mapped: its headers
    # checked first (a truncated file refused naming it) and its index followed.
    weights = locate(str(local.resolve()), weights_field(spec))
    return from_pretrained_lazy(weights, AutoConfig.from_pretrained(local), **options)


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


def build_meta_model(
    spec: ModelSpec,
    method: MethodSpec,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    *,
    architecture: ModelArchitecture | None,
    activation_checkpointing: bool,
    precision: Precision,
    construct_in: contextlib.AbstractContextManager[object] | None = None,
    object_store: ObjectStoreSpec | None = None,
    cache_dir: Path | None = None,
) -> nn.Module:
    """The model with LoRA adapters, on the meta device: shapes and dtypes only, no memory.
    Shard it (parallelize), then `materialize` it; QLoRA is built loaded (see above).
    `construct_in`: the context the base model is constructed in instead of the meta device
    (DeepSpeed ZeRO-3's `zero.Init`, which partitions each module as it is created:
    deepspeed_loading); the adapters are then created outside it, whole. `object_store`: where
    an s3:// model's files are (spec.storage.objectStore); `cache_dir`: the pod's data cache,
    where its config is fetched to (RuntimeEnv.data_cache_dir)."""
    if method.type == "qlora" and device.type != "cuda":
        raise UnsupportedConfigError(
            "method.type qlora needs a CUDA GPU (bitsandbytes 4-bit weights); "
            "use method.type lora on CPU"
        )
    if method.type == "qlora":
        model = _load_qlora_base(spec, device, object_store)
    else:
        config = model_config(spec, tokenizer, architecture, object_store, cache_dir)
        attn = _attention(spec, device)
        # dtype explicitly: transformers 5 defaults to "auto" (the checkpoint's own dtype),
        # which would silently drop full fine-tuning's fp32 master weights.
        with construct_in if construct_in is not None else torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, attn_implementation=attn, dtype=base_dtype(method, precision)
            )
    if activation_checkpointing:
        # Non-reentrant: composes with FSDP2 and with frozen (LoRA) base weights.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method.type in ("lora", "qlora"):
        on_meta = method.type == "lora" and construct_in is None
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            model = _add_lora(model, method)
    # A ZeRO-3 partitioned parameter is an empty placeholder; `ds_numel` is its real size.
    trainable = sum(
        getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad
    )
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    log.info("model %s: %d parameters, %d trainable", spec.name, total, trainable)
    return model


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def build_model(
    spec: ModelSpec,
    method: MethodSpec,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    *,
    activation_checkpointing: bool,
    precision: Precision,
    architecture: ModelArchitecture | None = None,
    seed: int | None = None,
    object_store: ObjectStoreSpec | None = None,
    cache_dir: Path | None = None,
) -> nn.Module:
    """A whole, unsharded model on `device` in the dtypes `precision` asks for (see the module
    docstring): the same weights the trainer gives its shards for this seed (default: the
    seed last given to torch.manual_seed)."""
    model = build_meta_model(
        spec,
        method,
        tokenizer,
        device,
        architecture=architecture or spec.architecture,
        activation_checkpointing=activation_checkpointing,
        precision=precision,
        object_store=object_store,
        cache_dir=cache_dir,
    )
    if is_meta(model):
        seed = torch.initial_seed() if seed is None else seed
        materialize(model, device, seed=seed, weights=weights_source(spec, object_store))
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, found by the class names HF lists in `_no_split_modules`."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]
