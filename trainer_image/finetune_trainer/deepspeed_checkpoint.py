"""What a DeepSpeed checkpoint holds, and the trained model gathered for export.

The format: the trainer's own committed DCP checkpoint (dcp_checkpointer.DcpCheckpointer, the same
store, COMMITTED marker + manifest, keep-last-K, skip-corrupt, async write), whose model and
optimizer entries are **one fp32 tensor per trainable parameter, by name**: the fp32 master
weight and each optimizer state (exp_avg, ...), read out of ZeRO's partitions with DeepSpeed's
fragment API and written back into them (deepspeed_fragments). Why this and not DeepSpeed's own
`save_checkpoint` + universal checkpoint conversion:

- world-size independent by construction: the names and sizes do not depend on the ZeRO
  stage or the number of ranks, so a checkpoint from 2 ranks loads into 1 or 3, and from
  ZeRO-2 into ZeRO-3, with no offline `ds_to_universal` pass between the kill and the resume
  (that pass reads every rank's files and rewrites them: minutes for a large model, on the
  critical path of an elastic re-form, and a second copy on the volume);
- one store: the COMMITTED/manifest/keep/quarantine logic is the torch path's, not a second
  implementation around DeepSpeed's `latest` file (which is written before all ranks finish);
- async: the tensors a save captures are fresh host copies, so the write and commit run in the
  checkpointer's background thread exactly as on the torch path.

Each tensor is saved flattened, each rank writing its own chunk of it (deepspeed_layout's
chunked layout: ZeRO-3's partition of the parameter), so a resume reads from storage only the
chunks overlapping what each rank holds (deepspeed_resume), not the whole checkpoint on every
rank. A save under ZeRO-3 gathers nothing (each rank writes the partition it holds); under
ZeRO-1/2 every rank gathers each tensor (an all-reduce of the fragments) and keeps its chunk.
Either way a save holds 1/N of the fp32 state on each rank's host, and the ranks write in
parallel. Checkpoints written before (one whole tensor per key) still load. The COMMITTED
marker records each trainable parameter's full shape (`marker_record`), which the flattened
tensors' metadata lacks, for the compatibility check (deepspeed_layout.comparable_shapes).

LoRA checkpoints hold only the adapters (the frozen base is not trainable), like the torch path.
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
from finetune_trainer.deepspeed_fragments import full_shape, local_chunk, refresh_low_precision
from finetune_trainer.deepspeed_layout import (
    CHUNKED,
    SHAPES_KEY,
    ChunkedLayout,
    comparable_shapes,
    is_chunked,
    saved_shapes,
)
from finetune_trainer.deepspeed_resume import Read, ResumeStats, restore_in_groups
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
        """Collective under ZeRO-1/2 (every rank, same order). Each rank captures its chunk of
        every tensor (deepspeed_layout), as a DTensor DCP writes with its place in the whole."""
        self._link_optimizer_state()
        layout = ChunkedLayout()
        model_sd: dict[str, Any] = {}
        optim_sd: dict[str, Any] = {}
        for name, p in _trainable(self._engine().module):
            numel = full_shape(p).numel()
            start, length = layout.chunk(numel)
            chunks = {
                key: layout.wrap(local_chunk(p, key, start, length, layout.world), numel)
                for key in ("", *self._state_keys())
            }  # the master first, then the states: the same order (collectives) on every rank
            model_sd[name] = chunks.pop("")
            optim_sd[name] = chunks
        return {CHUNKED: model_sd}, {CHUNKED: optim_sd}

    def _shapes(self) -> dict[str, list[int]]:
        return {name: list(full_shape(p)) for name, p in _trainable(self._engine().module)}

    def marker_record(self) -> dict[str, Any]:
        """The full shape of each trainable parameter, saved flattened (deepspeed_layout).
        Called in the commit thread: the shapes (ZeRO-3's `ds_shape`) never change."""
        return {SHAPES_KEY: self._shapes()}

    def comparable(
        self, saved: dict[str, Shape], expected: dict[str, Shape], marker: dict[str, Any]
    ) -> tuple[dict[str, Shape], dict[str, Shape]]:
        return comparable_shapes(saved, expected, marker.get(SHAPES_KEY), self._shapes())

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
        """The master weights and optimizer states in bounded groups, each rank reading what
        it holds (deepspeed_resume), then the rest of the state (step, sampler, schedule, RNG,
        loss scale) as on the torch path, with empty model and optimizer parts."""
        self._link_optimizer_state()
        self.resume_stats = restore_in_groups(
            _trainable(self._engine().module),
            self._state_keys(),
            read,
            stage3=self._stage() == 3,
            chunked=is_chunked(saved_keys),
        )
        # The forward's low-precision weights from the fp32 partitions just set (DeepSpeed's
        # own end-of-step copy and all-gather; under ZeRO-3 its small persistent parameters
        # are gathered whole again, as after every step).
        refresh_low_precision(self._engine().optimizer, stage3=self._stage() == 3)
        s = self.resume_stats
        log.info(
            "DeepSpeed resume (%s layout): %d groups of at most %d bytes; this rank asked for "
            "%d of the checkpoint's %d bytes of model and optimizer state",
            "chunked" if s.chunked else "whole", s.groups, s.budget, s.read_bytes, s.full_bytes,
        )  # fmt: skip
        super().load(read, saved_keys)

    def template_model_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return {}, {}  # read in groups by load()

    def expected_shapes(self, saved_keys: set[str]) -> dict[str, Shape]:
        """What `load` reads in groups, by name with full sizes (the same at any ZeRO stage
        and world size), in the layout of the checkpoint (`saved_keys`): every trainable
        parameter's master and optimizer states."""
        shapes = super().expected_shapes(saved_keys)  # train and RNG
        chunked = is_chunked(saved_keys)
        for name, p in _trainable(self._engine().module):
            shapes.update(saved_shapes(name, full_shape(p), self._state_keys(), chunked=chunked))
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
