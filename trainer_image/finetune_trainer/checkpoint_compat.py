"""Is a committed checkpoint one this job can resume from? Checked on the checkpoint's own DCP
metadata (every key with its full tensor size; read without reading a tensor) against what
the job would load (its state templates), before anything is loaded. A DeepSpeed checkpoint's
tensors are saved flattened (their metadata has element counts only): their full shapes come
from its COMMITTED marker's record, on both sides (`TrainState.comparable`,
deepspeed_layout.comparable_shapes); one written before that record is compared on counts.

A checkpoint written for another model or training setup is not damaged: the same job
deleted and re-applied under the same namespace/name takes its storage over to resume
(ownership.py), so a changed architecture, LoRA rank or targets, full <-> LoRA or a
strategy whose format differs (DeepSpeed <-> torch) meets the previous spec's checkpoints.
Treating that as damage would move every good checkpoint aside and train from step 0; and
a checkpoint holding *more* parameters than the model (a layer, a LoRA target removed)
would even load without any error, DCP reading only the keys it is asked for. So the
trainer refuses (`IncompatibleCheckpointError`, a configuration error: the job fails at
once, as TrainerRefused) and touches nothing.

What still loads: another world size, FSDP <-> DDP, another ZeRO stage (sizes are the full,
unsharded ones on every path, names normalised by `get_state_dict` / by parameter name),
another rank count's RNG streams, and anything that is not a tensor of the model or the
optimizer (the step, sampler and schedule travel as one `train` entry).

Not another model either, so loaded (with a warning line naming them; `tolerate`):
- a parameter with no optimizer state in the checkpoint while others have some: it never got
  a gradient before the save (an MoE expert no token was routed to, a part of the model the
  data never reached). Its state is left out, as it was in the saving run: the optimizer
  creates it at the parameter's first gradient, as on a first step.
- an optimizer setting (param-group key) one side has and the other lacks: another torch
  records another set. One the checkpoint lacks keeps this job's value; one this job lacks is
  not read. Its model weights' keys and sizes still have to match exactly.
- a per-parameter optimizer state (`optim.state.<param>.<name>`) that the checkpoint holds
  and this job's optimizer keeps for no parameter at all: a newer torch's optimizer records
  more per parameter (or an older one did). It is not read: this optimizer never reads it,
  and every state it does keep must still be in the checkpoint with its size, so its updates
  are the ones it would have made.

Still refused: a per-parameter state this job's optimizer keeps that the checkpoint lacks
(an older torch's checkpoint for a newer optimizer, or one with state this job has for a
parameter of the checkpoint's that has other state). A torch optimizer creates a parameter's
state only when it has none, all at once: one state missing would fail its first step, and
filled with its initial value (a running average at zero) it would change the maths, with no
error, for every step after the resume.

What counts as damage stays damage (dcp_checkpointer skips to the previous checkpoint):
unreadable metadata, a missing COMMITTED marker, a manifest or size mismatch, a failing
read. Only a checkpoint that has passed those checks is compared here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from finetune_trainer.errors import UnsupportedConfigError

# A saved entry's full size; None: not a tensor (DCP pickles it as bytes).
Shape = tuple[int, ...] | None
# The checkpoint entries that hold learned values: one of them in the checkpoint but not in
# the job would be dropped without an error. Anything else the job does not ask for (other
# ranks' RNG streams, hyperparameters a newer torch records) is ignored, as DCP ignores it.
LEARNED_PREFIXES = ("model.", "optim.")
SHOWN = 3  # differences named in a refusal; the rest are counted
STATE = "optim.state."  # + parameter FQN + "." + state name (exp_avg, step: no dots)
GROUPS = "optim.param_groups."  # + group index + "." + setting (lr, betas, params)


class IncompatibleCheckpointError(UnsupportedConfigError):
    """A committed, undamaged checkpoint written for another model or training setup."""


@dataclass(frozen=True)
class Difference:
    """One key on which the checkpoint and the job disagree (`absent` on one side)."""

    key: str
    saved: Shape
    expected: Shape
    in_checkpoint: bool = True
    in_job: bool = True

    def describe(self) -> str:
        saved = _show(self.saved) if self.in_checkpoint else "absent"
        expected = _show(self.expected) if self.in_job else "absent"
        return f"{self.key} (checkpoint: {saved}, this job: {expected})"


def _show(shape: Shape) -> str:
    return "not a tensor" if shape is None else str(list(shape))


@dataclass(frozen=True)
class Allowance:
    """What the checkpoint lacks, or holds more of, without being another model's: the
    torch optimizer's layout only (a DeepSpeed checkpoint has neither `optim.state.` nor
    `optim.param_groups.` keys, so nothing is ever allowed there)."""

    stateless: tuple[str, ...] = ()  # parameters (FQN) with no optimizer state saved
    added: tuple[tuple[int, str], ...] = ()  # (group, setting) this job has, the checkpoint not
    dropped: tuple[tuple[int, str], ...] = ()  # (group, setting) the checkpoint has, this job not
    unread_state: tuple[str, ...] = ()  # per-parameter state names this optimizer keeps not
    keys: frozenset[str] = field(default_factory=frozenset)  # every key of both sides concerned

    def __bool__(self) -> bool:
        return bool(self.stateless or self.added or self.dropped or self.unread_state)

    def describe(self) -> str:
        """The warning line: what is loaded differently, and why that is not another model."""
        parts = []
        if self.stateless:
            parts.append(
                f"{len(self.stateless)} parameter(s) have no optimizer state in it (no gradient "
                "before the save, e.g. an MoE expert no token was routed to): their state "
                f"starts at their first gradient, as on a first step: {_names(self.stateless)}"
            )
        if self.added:
            parts.append(
                "optimizer settings it lacks (another torch) keep this job's values: "
                + _names([f"group {g} {k}" for g, k in self.added])
            )
        if self.dropped:
            parts.append(
                "optimizer settings this torch does not have are not read: "
                + _names([f"group {g} {k}" for g, k in self.dropped])
            )
        if self.unread_state:
            parts.append(
                "per-parameter optimizer state this torch's optimizer does not keep is not "
                "read (every state it keeps is): " + _names(self.unread_state)
            )
        return "; ".join(parts)

    def leave_out(self, sd: dict[str, Any]) -> dict[tuple[int, str], Any]:
        """Take what the checkpoint lacks out of `sd` (a `TrainState` state dict, nested) so
        DCP does not look for it: the stateless parameters' optimizer state, and the settings
        added, returned with this job's values to be set again after the load."""
        optim = sd.get("optim", {})
        for fqn in self.stateless:
            optim["state"].pop(fqn, None)
        return {(g, k): optim["param_groups"][g].pop(k) for g, k in self.added}


def _names(items: Collection[str]) -> str:
    shown = ", ".join(list(items)[:SHOWN])
    more = len(items) - SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _state_param(key: str) -> str:
    return key[len(STATE) :].rsplit(".", 1)[0]


def _state_name(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _unread_state(saved: Collection[str], expected: Collection[str]) -> tuple[list[str], set[str]]:
    """The per-parameter state names only the checkpoint holds, for parameters with state on
    both sides, that this job's optimizer keeps for no parameter (module docstring), and the
    checkpoint's keys of them. Nothing when the job's optimizer keeps no state at all."""
    job_states = {k for k in expected if k.startswith(STATE)}
    kept_names = {_state_name(k) for k in job_states}
    job_params = {_state_param(k) for k in job_states}
    names: dict[str, None] = {}
    keys: set[str] = set()
    for key in saved:
        if not key.startswith(STATE) or key in expected:
            continue
        name = _state_name(key)
        if kept_names and name not in kept_names and _state_param(key) in job_params:
            names[name] = None
            keys.add(key)
    return list(names), keys


def _group_setting(key: str) -> tuple[int, str] | None:
    group, _, setting = key[len(GROUPS) :].partition(".")
    return (int(group), setting.split(".")[0]) if group.isdigit() and setting else None


def tolerate(saved: Collection[str], expected: Collection[str]) -> Allowance:
    """The keys on which the checkpoint (`saved`) and the job (`expected`) differ for a reason
    that is not another model (module docstring). Keys only: a size that differs is never
    allowed. A stateless parameter must be in the model on both sides, and the checkpoint
    must hold optimizer state for some other one (else it is no torch optimizer's)."""
    saved_params = {_state_param(k) for k in saved if k.startswith(STATE)}
    job_params = dict.fromkeys(_state_param(k) for k in expected if k.startswith(STATE))
    stateless = [
        p
        for p in job_params
        if saved_params
        and p not in saved_params
        and f"model.{p}" in saved
        and f"model.{p}" in expected
    ]
    without = set(stateless)
    keys = {k for k in expected if k.startswith(STATE) and _state_param(k) in without}

    def settings(side: Collection[str], other: Collection[str]) -> list[tuple[int, str]]:
        found: dict[tuple[int, str], None] = {}
        for key in side:
            gs = _group_setting(key) if key.startswith(GROUPS) and key not in other else None
            # Only in a group both sides have (its parameter list saved): never a group more.
            if gs is not None and gs[1] != "params" and f"{GROUPS}{gs[0]}.params" in other:
                found[gs] = None
                keys.add(key)
        return list(found)

    added, dropped = settings(expected, saved), settings(saved, expected)
    unread, unread_keys = _unread_state(saved, expected)
    keys |= unread_keys
    return Allowance(tuple(stateless), tuple(added), tuple(dropped), tuple(unread), frozenset(keys))


def compare(saved: Mapping[str, Shape], expected: Mapping[str, Shape]) -> list[Difference]:
    """The differences that make a checkpoint unusable for this job: a key the job loads that
    the checkpoint lacks, a size (or tensor/non-tensor) that differs, and a learned tensor of
    the checkpoint the job has no place for; but not what `tolerate` allows. Empty:
    compatible. The model's come first, then in the job's order (its parameters' order),
    then the checkpoint's."""
    allowed = tolerate(saved, expected).keys
    keys = [*expected, *(k for k in saved if k not in expected)]
    keys.sort(key=lambda k: not k.startswith("model."))  # stable
    out: list[Difference] = []
    for key in keys:
        if key in allowed:
            continue
        if key not in saved:
            out.append(Difference(key, None, expected[key], in_checkpoint=False))
        elif key not in expected:
            if saved[key] is not None and key.startswith(LEARNED_PREFIXES):
                out.append(Difference(key, saved[key], None, in_job=False))
        elif saved[key] != expected[key]:
            out.append(Difference(key, saved[key], expected[key]))
    return out


def refusal_message(
    step: int,
    where: str,
    differences: list[Difference],
    *,
    saved_backend: str | None = None,
    backend: str | None = None,
) -> str:
    """What the job's failure says: which checkpoint, the first differences with both sizes,
    that nothing was touched, and the two ways on. The backends (from the COMMITTED marker
    and this job's plan) are named only where they differ: their formats do (DeepSpeed's
    optimizer states are by name, torch's under `optim.state`), while a strategy within one
    backend (ZeRO stage, FSDP or DDP, world size) changes nothing saved."""
    shown = "; ".join(d.describe() for d in differences[:SHOWN])
    more = len(differences) - SHOWN
    if more > 0:
        shown += f"; and {more} more"
    written = ""
    if saved_backend and backend and saved_backend != backend:
        written = (
            f" It was written by the {saved_backend} backend, this job runs {backend}: their "
            "checkpoint formats differ."
        )
    return (
        f"checkpoint step {step} in {where} was written for another model or training setup "
        f"than this job's: {len(differences)} entries differ: {shown}.{written} It is not "
        "damaged and was left untouched, as were the others there. To start afresh, point "
        "checkpoint.uri elsewhere; to resume from it, restore the spec that wrote it "
        "(model, method and its lora settings, strategy.backend)."
    )


def metadata_shapes(state_dict_metadata: Mapping[str, Any]) -> dict[str, Shape]:
    """The checkpoint's side, from DCP's `Metadata.state_dict_metadata`: a tensor entry
    (`TensorStorageMetadata`) has its full `size`; a bytes entry none."""
    shapes: dict[str, Shape] = {}
    for key, entry in state_dict_metadata.items():
        size = getattr(entry, "size", None)
        shapes[key] = tuple(int(n) for n in size) if size is not None else None
    return shapes


def state_dict_shapes(state_dict: Mapping[str, Any]) -> dict[str, Shape]:
    """The job's side: a state dict to load into, keyed as DCP flattens it (nested mappings
    joined by dots; a list only where it holds tensors or mappings, by index), with each
    tensor's full size (a DTensor's global one)."""
    shapes: dict[str, Shape] = {}

    def visit(path: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit(f"{path}.{k}", v)
        elif isinstance(value, list) and any(_holds_tensors(v) for v in value):
            for i, v in enumerate(value):
                visit(f"{path}.{i}", v)
        elif isinstance(value, torch.Tensor):
            shapes[path] = tuple(int(n) for n in value.shape)
        else:
            shapes[path] = None

    for key, value in state_dict.items():
        visit(str(key), value)
    return shapes


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor | Mapping):
        return True
    return isinstance(value, list) and any(_holds_tensors(v) for v in value)
