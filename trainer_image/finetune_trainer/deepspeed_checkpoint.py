"""What a DeepSpeed checkpoint holds, and the trained model gathered for export.

The format: the trainer's own committed DCP checkpoint (dcp_checkpointer.DcpCheckpointer, the same
store, COMMITTED marker + manifest, keep-last-K, skip-corrupt, async write), whose model and
optimizer entries are **one full fp32 tensor per trainable parameter, by name**: the fp32
master weight (`model.<name>`) and each optimizer state (`optim.<name>.exp_avg`, ...), read
out of ZeRO's partitions with DeepSpeed's public fragment API (`safe_get_full_fp32_param`,
`safe_get_full_optimizer_state`) and written back with its setters. Why this and not
DeepSpeed's own `save_checkpoint` + universal checkpoint conversion:

- world-size independent by construction: the names and shapes do not depend on the ZeRO
  stage or the number of ranks, so a checkpoint from 2 ranks loads into 1 or 3, and from
  ZeRO-2 into ZeRO-3, with no offline `ds_to_universal` pass between the kill and the resume
  (that pass reads every rank's files and rewrites them: minutes for a large model, on the
  critical path of an elastic re-form, and a second copy on the volume);
- one store: the COMMITTED/manifest/keep/quarantine logic is the torch path's, not a second
  implementation around DeepSpeed's `latest` file (which is written before all ranks finish);
- async: the gather is a collective on the training group (main thread, blocking), but the
  tensors it returns are fresh copies, so the write and commit run in the checkpointer's
  background thread exactly as on the torch path.

The cost: every rank gathers every parameter (ZeRO-1/2: an all-reduce of its fragment;
ZeRO-3: an all-gather), but keeps only the parameters it owns (round-robin by name), so the
host memory a save holds is 1/N of the fp32 state and the ranks write in parallel. A load
reads the tensors in groups of at most 1 GiB (finetune_trainer.deepspeed_resume), each rank
only those it has a fragment of (every master weight; the optimizer states of its own ZeRO-1/2
partitions), so the host memory a resume adds is bounded whatever the model's size.

The low-precision module weights are set from the loaded masters too (ZeRO-1/2: every rank
holds them whole; ZeRO-3: through `GatheredParameters`, rank 0's copy re-partitioned). LoRA
checkpoints hold only the adapters (the frozen base is not trainable), like the torch path.
fp16's dynamic loss scale and the optimizer's step count travel in the `train` entry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from finetune_trainer.checkpoint_compat import Shape
from finetune_trainer.deepspeed_resume import Read, ResumeStats, full_shape, restore_in_groups
from finetune_trainer.state import TrainState

log = logging.getLogger(__name__)

# Optimizer states per parameter, by torch optimizer: what the fragment API can address
# (tensors shaped like the parameter; Adam's scalar `step` travels separately).
OPTIMIZER_STATE_KEYS = {
    "AdamW": ("exp_avg", "exp_avg_sq"),
    "Adam": ("exp_avg", "exp_avg_sq"),
    "SGD": ("momentum_buffer",),
}
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


@dataclass
class DeepSpeedTrainState(TrainState):
    """TrainState over a DeepSpeed engine (`model`) and the torch optimizer it wraps."""

    resume_stats: ResumeStats | None = None  # what the last load() read, for its log line

    def _engine(self) -> Any:
        return self.model

    def _state_keys(self) -> tuple[str, ...]:
        return OPTIMIZER_STATE_KEYS.get(type(self.optimizer).__name__, ())

    def _link_optimizer_state(self) -> None:
        """ZeRO-1/2 link the optimizer states to the parameters' fragments lazily, at the first
        step; a save or load before then needs the link (and the states) now."""
        zero = self._engine().optimizer
        keys = self._state_keys()
        # ZeRO's fp32 partitions, one per (sub-)group: what the torch optimizer steps (ZeRO-3
        # swaps each into the torch optimizer's param_groups only while stepping it).
        partitions = getattr(zero, "fp32_partitioned_groups_flat", None)
        if partitions is None:
            partitions = zero.single_partition_of_fp32_groups
        for i, p in enumerate(partitions):
            if all(k in self.optimizer.state.get(p, {}) for k in keys):
                continue
            # No step yet (ZeRO-3 even creates empty state entries at initialize): create the
            # states with a zero-gradient step of that group (the values it leaves are
            # overwritten by the load; a save after a real step never gets here). The
            # partition's gradient buffer is put back (offload keeps it for good).
            kept, p.grad = p.grad, torch.zeros_like(p)
            zero._optimizer_step(i)
            p.grad = kept
        link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            # Link again, now that every group has its states: DeepSpeed 0.19 links all groups
            # after stepping the first one, so with several param groups (decay / no decay)
            # the others were linked to empty states and never again.
            zero._hp_optimizer_states_linked = False
            link()

    def _stage(self) -> int:
        return int(self._engine().zero_optimization_stage())

    # ---- save ------------------------------------------------------------------------------

    def capture_model_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Collective (every rank, same order). Each rank keeps the parameters it owns."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        self._link_optimizer_state()
        world, rank = dist.get_world_size(), dist.get_rank()
        model_sd: dict[str, Any] = {}
        optim_sd: dict[str, Any] = {}
        for i, (name, p) in enumerate(_trainable(self._engine().module)):
            mine = i % world == rank
            full = safe_get_full_fp32_param(p)
            states = {k: safe_get_full_optimizer_state(p, k) for k in self._state_keys()}
            if mine:
                model_sd[name] = full.detach().cpu()
                optim_sd[name] = {k: v.detach().cpu() for k, v in states.items()}
        return model_sd, optim_sd

    def capture_train_extra(self) -> dict[str, Any]:
        steps = [
            float(s["step"]) for s in self.optimizer.state.values() if "step" in s
        ]  # AdamW's step count (the same in every group); SGD has none
        extra: dict[str, Any] = {"optimizer_step": max(steps) if steps else 0.0}
        scaler = getattr(self._engine().optimizer, "loss_scaler", None)
        if scaler is not None:
            extra["loss_scaler"] = {
                f: getattr(scaler, f) for f in _SCALER_FIELDS if hasattr(scaler, f)
            }
        return extra

    # ---- load ------------------------------------------------------------------------------

    def load(self, read: Read, saved_keys: set[str]) -> None:
        """The master weights and optimizer states in bounded groups (deepspeed_resume),
        then the rest of the state (step, sampler, schedule, RNG, loss scale) as on the
        torch path, with empty model and optimizer parts."""
        self._link_optimizer_state()
        self.resume_stats = restore_in_groups(
            _trainable(self._engine().module),
            self._state_keys(),
            read,
            stage3=self._stage() == 3,
        )
        s = self.resume_stats
        log.info(
            "DeepSpeed resume: %d groups of at most %d bytes; this rank read %d of the "
            "checkpoint's %d bytes of model and optimizer state",
            s.groups, s.budget, s.read_bytes, s.full_bytes,
        )  # fmt: skip
        super().load(read, saved_keys)

    def template_model_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return {}, {}  # read in groups by load()

    def expected_shapes(self, saved_keys: set[str]) -> dict[str, Shape]:
        """What `load` reads in groups, by name with full sizes (the same at any ZeRO stage
        and world size): every trainable parameter's master and optimizer states."""
        shapes = super().expected_shapes(saved_keys)  # train and RNG
        for name, p in _trainable(self._engine().module):
            size = tuple(int(n) for n in full_shape(p))
            shapes[f"model.{name}"] = size
            shapes.update({f"optim.{name}.{k}": size for k in self._state_keys()})
        return shapes

    def restore_model_optim(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        return None  # restored in groups by load()

    def restore_train_extra(self, train: dict[str, Any]) -> None:
        step = train.get("optimizer_step")
        if step:
            for s in self.optimizer.state.values():
                if isinstance(s.get("step"), torch.Tensor):
                    s["step"].fill_(float(step))
                elif "step" in s:
                    s["step"] = step
        scaler = getattr(self._engine().optimizer, "loss_scaler", None)
        for field, value in (train.get("loss_scaler") or {}).items():
            if scaler is not None and hasattr(scaler, field):
                setattr(scaler, field, value)


def gather_module_state_dict(module: nn.Module, stage: int) -> dict[str, torch.Tensor]:
    """Collective. Rank 0 gets the model's state dict on CPU with every trainable parameter
    as its fp32 master (as the torch path exports it) and frozen ones in their dtype; the other
    ranks get an empty dict."""
    from deepspeed.runtime.zero import GatheredParameters
    from deepspeed.utils import safe_get_full_fp32_param

    rank0 = dist.get_rank() == 0
    params = {id(p) for p in module.parameters()}
    gathered: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key, t in module.state_dict(keep_vars=True).items():
        if id(t) not in gathered:
            if id(t) in params and t.requires_grad:
                full = safe_get_full_fp32_param(t).detach().cpu()
            elif id(t) in params and stage == 3:
                with GatheredParameters([t]):
                    full = t.detach().cpu().clone()
            else:
                full = t.detach().cpu().clone() if rank0 else t
            gathered[id(t)] = full
        if rank0:
            out[key] = gathered[id(t)]
    return out
