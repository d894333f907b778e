"""What a checkpoint holds, as a DCP state dict: model, optimizer, scheduler, sampler position,
step and RNG. Model and optimizer go through `get_state_dict`/`set_state_dict`, so a checkpoint
written by N ranks loads into M ranks (DCP reshards).

Only what changes: with frozen parameters (LoRA/QLoRA) the model part holds the trainable ones
(`ignore_frozen_params`): the adapters, a few MB, instead of the whole base. A resume loads them
onto a base the trainer has just loaded again from the same source (pretrained weights, or
the seeded init of an inline model, which does not depend on the world size)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.optim.lr_scheduler import LRScheduler

from finetune_trainer.checkpoint_compat import Shape, state_dict_shapes, tolerate
from finetune_trainer.loss_scale import LossScale, NoLossScale
from finetune_trainer.sampler import StepSampler

RNG_PREFIX = "rng"


class Read(Protocol):
    """Loads the checkpoint's values of the keys of the state dict it is given, in place (DCP's
    load, a collective), with `planner` where given (DeepSpeed's ranges of flattened tensors:
    deepspeed_layout.RangeLoadPlanner), DCP's default planner otherwise."""

    def __call__(self, state_dict: dict[str, Any], planner: LoadPlanner | None = None) -> None: ...


@dataclass
class TrainState:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    sampler: StepSampler
    rank: int
    seed: int
    step: int = 0
    loss_scale: LossScale = field(default_factory=NoLossScale)
    # False while restoring a checkpoint that lacks some parameters' optimizer state (they
    # never had a gradient): set_state_dict would refuse it as strict.
    _strict: bool = field(default=True, init=False, repr=False)

    def _rng_key(self) -> str:
        # One entry per rank (each rank's dropout stream); a rank missing from an older,
        # smaller world is reseeded from (seed, rank, step) instead.
        return f"rank{self.rank}"

    def _options(self) -> StateDictOptions:
        frozen = any(not p.requires_grad for p in self.model.parameters())
        # strict=False on load: the frozen base is absent from the checkpoint by design.
        return StateDictOptions(ignore_frozen_params=frozen, strict=self._strict and not frozen)

    # The model and optimizer parts: get_state_dict/set_state_dict here; other backends
    # (deepspeed_checkpoint.DeepSpeedTrainState) override these four (and load) and keep the rest.
    def capture_model_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        return model_sd, optim_sd

    def template_model_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.capture_model_optim()

    def restore_model_optim(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=self._options(),
        )

    def capture_train_extra(self) -> dict[str, Any]:
        return {}

    def restore_train_extra(self, train: dict[str, Any]) -> None:
        return None

    def capture(self) -> dict[str, Any]:
        return self._assemble(*self.capture_model_optim())

    def _assemble(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> dict[str, Any]:
        rng: dict[str, torch.Tensor] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        train = {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            **self.capture_train_extra(),
        }
        if scale := self.loss_scale.state_dict():
            train["loss_scale"] = scale  # fp16 only
        return {
            "model": model_sd,
            "optim": optim_sd,
            "train": json.dumps(train),  # replicated: DCP writes it once
            RNG_PREFIX: {self._rng_key(): rng},
        }

    def template(self, saved_keys: set[str]) -> dict[str, Any]:
        """The state dict to load into; RNG only if this rank's entry was saved."""
        sd = self._assemble(*self.template_model_optim())
        prefix = f"{RNG_PREFIX}.{self._rng_key()}."
        if not any(k.startswith(prefix) for k in saved_keys):
            del sd[RNG_PREFIX]
        return sd

    def expected_shapes(self, saved_keys: set[str]) -> dict[str, Shape]:
        """Every key `load` would read from a checkpoint whose keys are `saved_keys`, with its
        full size: what checkpoint_compat compares with the checkpoint's metadata."""
        return state_dict_shapes(self.template(saved_keys))

    def marker_record(self) -> dict[str, Any]:
        """What a commit adds to the checkpoint's COMMITTED marker (JSON) for `comparable`:
        nothing here, every tensor being saved with its full shape."""
        return {}

    def comparable(
        self, saved: dict[str, Shape], expected: dict[str, Shape], marker: dict[str, Any]
    ) -> tuple[dict[str, Shape], dict[str, Shape]]:
        """The checkpoint's shapes and `expected_shapes` as checkpoint_compat compares them,
        given the checkpoint's marker: as they are here (DeepSpeed's flattened tensors take
        their full shapes from `marker_record`'s)."""
        return saved, expected

    def load(self, read: Read, saved_keys: set[str]) -> None:
        """Fill this state from a checkpoint whose keys are `saved_keys`: `read(sd)` loads the
        checkpoint's values of the keys of `sd` into it in place (DCP's load, a collective:
        every rank calls it equally often). A backend whose model and optimizer cannot be
        held whole at once reads them in parts first (DeepSpeedTrainState)."""
        sd = self.template(saved_keys)
        # What the checkpoint lacks without being another model's (checkpoint_compat; the
        # checkpointer has refused anything else and logged this): not read from it.
        allowance = tolerate(saved_keys, state_dict_shapes(sd))
        kept = allowance.leave_out(sd)
        read(sd)
        self._strict = not allowance.stateless
        try:
            self.restore(sd)
        finally:
            self._strict = True
        # The optimizer took the checkpoint's param groups, without the settings it lacks.
        for (group, setting), value in kept.items():
            self.optimizer.param_groups[group][setting] = value

    def restore(self, sd: dict[str, Any]) -> None:
        self.restore_model_optim(sd["model"], sd["optim"])
        train = json.loads(sd["train"])
        self.restore_train_extra(train)
        self.step = int(train["step"])
        self.sampler.load_state_dict(train["sampler"])
        self.scheduler.load_state_dict(train["scheduler"])
        # A checkpoint without one (bf16, or written before fp16 existed) keeps the initial scale.
        self.loss_scale.load_state_dict(train.get("loss_scale", {}))
        # Recompute the LR from this run's schedule (its maxSteps may differ from the saved one).
        self.scheduler.last_epoch = self.step - 1
        self.scheduler.step()
        rng = sd.get(RNG_PREFIX, {}).get(self._rng_key())
        if rng is None:
            torch.manual_seed(self.seed + 100_003 * self.rank + self.step)
        else:
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
