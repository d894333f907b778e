"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from finetune_operator.api.spec import TrainingSpec
from finetune_trainer.errors import UnsupportedConfigError


def lr_factor(step: int, *, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the peak LR for the optimizer step with index `step` (0-based):
    linear warm-up over `warmup` steps, then cosine/linear decay to 0 at `total`, or constant."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}")


def _param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, object]]:
    # Matrices decay; norms and biases (1-D) do not. A ZeRO-3 parameter built under zero.Init
    # is an empty partition placeholder: its real shape is `ds_shape`.
    decay, no_decay = [], []
    for p in params:
        if p.requires_grad:
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def adamw_implementation(params: Iterable[nn.Parameter]) -> dict[str, bool]:
    """The fused AdamW kernel where every trainable parameter is on a CUDA device: one launch
    per step and no state-sized temporaries (foreach allocates sqrt(v) for a whole group,
    which the planner counts as the optimizer phase's buffers, memory._optimizer_temp).
    Elsewhere torch's default (foreach, or the per-tensor loop on CPU)."""
    trainable = [p for p in params if p.requires_grad]
    if trainable and all(p.device.type == "cuda" for p in trainable):
        return {"fused": True}
    return {}


def build_optimizer(model: nn.Module, spec: TrainingSpec) -> torch.optim.Optimizer:
    groups = _param_groups(model.parameters(), spec.weight_decay)
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(
            groups,
            lr=spec.learning_rate,
            betas=(0.9, 0.95),
            eps=1e-8,
            **adamw_implementation(model.parameters()),
        )
    if spec.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=spec.learning_rate, momentum=0.9)
    if spec.optimizer == "adamw8bit":
        return adamw8bit(model, groups, spec.learning_rate)
    raise UnsupportedConfigError(
        f"training.optimizer {spec.optimizer!r} is not implemented yet; use adamw or sgd"
    )


def adamw8bit(
    model: nn.Module, groups: list[dict[str, object]], lr: float
) -> torch.optim.Optimizer:
    """bitsandbytes' blockwise 8-bit AdamW (1 byte per state value plus an fp32 absmax per
    256: what the planner counts, model_states.ADAM8BIT_BYTES_PER_STATE), same hyper-parameters as
    the 32-bit one. Imported here only: bitsandbytes ships CUDA kernels and is in the trainer
    image, not in CPU installs. It steps plain tensors, not FSDP2's sharded DTensors (the
    strategy table lets adamw8bit run under ddp only; the planner never picks otherwise)."""
    if any(isinstance(p, DTensor) for p in model.parameters() if p.requires_grad):
        raise UnsupportedConfigError(
            "training.optimizer adamw8bit cannot step FSDP2's sharded parameters "
            "(bitsandbytes needs plain tensors); use strategy.type ddp or optimizer adamw"
        )
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise UnsupportedConfigError(
            "training.optimizer adamw8bit needs bitsandbytes, which this trainer install lacks "
            "(the trainer image has it); use adamw"
        ) from e
    optimizer: torch.optim.Optimizer = bnb.optim.AdamW8bit(
        groups, lr=lr, betas=(0.9, 0.95), eps=1e-8
    )
    return optimizer


def build_scheduler(
    optimizer: torch.optim.Optimizer, spec: TrainingSpec, total_steps: int
) -> LambdaLR:
    warmup, schedule = spec.warmup_steps, spec.schedule
    return LambdaLR(
        optimizer,
        lambda s: lr_factor(s, warmup=warmup, total=total_steps, schedule=schedule),
    )
