"""Pretrained Hugging Face weights (safetensors) read straight into a model's shards.

DCP's `HuggingFaceStorageReader` plans the read like a checkpoint load: each rank asks only
for the slices its DTensor shards cover and safetensors reads just those bytes (`get_slice`),
so no rank ever holds a whole tensor it does not own. Under DDP the parameters are plain
tensors and every rank reads them whole (a full replica is what DDP is). The checkpoint's
dtype is converted on copy (bf16 on disk into fp32 masters for full fine-tuning)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from finetune_trainer.errors import UnsupportedConfigError

# peft wraps each targeted linear: its weight moves under `.base_layer`.
_PEFT_BASE = ".base_layer."


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face PreTrainedModel inside a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def checkpoint_keys(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's base parameters under their Hugging Face checkpoint names; a tied head
    appears once, as the embedding (checkpoints of tied models omit `lm_head.weight`)."""
    out: dict[str, nn.Parameter] = {}
    for name, param in hf_model(model).named_parameters(remove_duplicate=True):
        if ".lora_" in name:
            continue
        out[name.replace(_PEFT_BASE, ".")] = param
    return out


def has_safetensors(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*.safetensors"))


def load_safetensors(model: nn.Module, path: Path) -> set[int]:
    """Read every base parameter of `model` from the safetensors in `path`; returns the ids
    of the parameters filled. A missing or mis-shaped tensor is an error naming the model."""
    if not has_safetensors(path):
        raise UnsupportedConfigError(
            f"spec.model: no *.safetensors weights in {path} (the trainer reads Hugging "
            "Face safetensors; convert .bin checkpoints with save_pretrained)"
        )
    params = checkpoint_keys(model)
    state: dict[str, torch.Tensor] = dict(params)
    try:
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(path)))
    except Exception as exc:  # DCP wraps per-rank failures in CheckpointException
        raise UnsupportedConfigError(
            f"spec.model: cannot read the weights in {path} into the model built from "
            f"its config: {exc}"
        ) from exc
    return {id(p) for p in params.values()}
