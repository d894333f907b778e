"""Dynamic loss scaling for fp16 on the torch backend; a no-op object in bf16 and fp32.

fp16's 5-bit exponent underflows small gradients, so the loss is multiplied by a scale before
backward and the gradients divided by it before clipping and the optimizer step. A step whose
gradients hold an inf or NaN (the scale was too large, or the step overflowed) is skipped and
the scale halved; after `growth_interval` clean steps it doubles again.

All ranks must skip the same steps, or their replicas diverge (DDP) or their shards belong to
different steps (FSDP). torch's `ShardedGradScaler` is `torch.amp.GradScaler` plus exactly
that: after unscaling it all-reduces the found-inf flag over the process group, and it runs
on CPU too. With FSDP2 the gradients are sharded DTensors, each rank checking only its own
shard (an overflow in one shard's reduce-scatter lands on that rank alone); DTensor's
dispatch of the inf check already reduces the flag over the mesh, and the scaler's
all-reduce makes the agreement explicit for DDP's plain tensors as well.

The LR schedule advances on a skipped step too: the schedule follows the step count (a
resume recomputes the LR from it, `state.TrainState.restore`), not the number of updates.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

# torch's GradScaler defaults: start at 2^16, halve on overflow, double after 2000 clean steps.
INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2000


class LossScale(Protocol):
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call backward on."""

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale (before clipping), agreeing on overflow."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Apply the optimizer step unless the gradients overflowed; True when applied."""

    def value(self) -> float | None:
        """The current scale; None when not scaling."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class NoLossScale:
    """bf16 and fp32: nothing to scale, every step applies."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        return None

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        optimizer.step()
        return True

    def value(self) -> float | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class DynamicLossScale:
    """fp16: torch's ShardedGradScaler over the training process group (the default one)."""

    def __init__(
        self,
        device: torch.device,
        *,
        init_scale: float = INIT_SCALE,
        growth_interval: int = GROWTH_INTERVAL,
    ) -> None:
        self.scaler = ShardedGradScaler(
            device.type, init_scale=init_scale, growth_interval=growth_interval
        )
        self.skipped = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)  # skips optimizer.step() when the agreed flag is set
        self.scaler.update()
        # update() lowers the scale exactly when the step was skipped.
        applied = self.scaler.get_scale() >= before
        self.skipped += not applied
        return applied

    def value(self) -> float | None:
        return float(self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scaler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.scaler.load_state_dict(state)


def build_loss_scale(precision: str, device: torch.device, backend: str = "fsdp") -> LossScale:
    """fp16 on the torch backend scales here; DeepSpeed scales inside its engine (its own
    dynamic loss scaler), so the loop must not scale its loss a second time."""
    if precision == "fp16" and backend == "fsdp":
        return DynamicLossScale(device)
    return NoLossScale()
