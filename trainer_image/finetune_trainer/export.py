"""The trained model as a Hugging Face directory (`spec.output`), written once training completes.

Every rank gathers the full state dict (a collective that works for plain, DDP and FSDP2/DTensor
parameters; only rank 0 receives it, on CPU); rank 0 then writes:

- full fine-tuning: the model (`config.json`, `model.safetensors`, generation config);
- LoRA/QLoRA: the peft adapter (`adapter_config.json`, `adapter_model.safetensors`), or with
  `mergeLora` the base model with the adapters merged into its weights;
- the tokenizer, and last a `FINISHED` marker (JSON: step, loss, strategy, method, time).

On a volume the directory is written as `<uri>.tmp-<step>` and renamed into place, so `<uri>`
is either the previous export, absent for an instant while it is replaced, or a complete new one
with its marker. An object store (`s3://`) has no rename: the export is written to a local
temp directory (the pod's /tmp), the previous export's marker is deleted, then its objects, the
new files are uploaded and the marker last, so an export is complete exactly when `FINISHED`
is there. `NoOpExporter` stands in when `output.uri` is unset.
"""

from __future__ import annotations

import copy
import glob
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from finetune_operator.api.spec import MethodSpec, OutputSpec
from finetune_operator.api.storage import ObjectStoreSpec
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.files import fsync_dir, remove
from finetune_trainer.location import Location, locate
from finetune_trainer.ownership import StorageRefusedError, check_output_target

log = logging.getLogger(__name__)

FINISHED_MARKER = "FINISHED"
_TMP_INFIX = ".tmp-"
_OLD_INFIX = ".old-"


class Exporter(Protocol):
    def export(self, step: int, *, loss: float | None = None) -> Location | None:
        """Collective: every rank calls it. Returns the output directory on rank 0."""
        ...


class NoOpExporter:
    """`output.uri` unset: the trained model is only in the checkpoints."""

    def export(self, step: int, *, loss: float | None = None) -> Location | None:
        return None


def resolve_output(
    uri: str, cwd: Path | None = None, object_store: ObjectStoreSpec | None = None
) -> Location:
    """`output.uri` as a Location (see `location.locate`)."""
    return locate(uri, "output.uri", cwd=cwd, object_store=object_store)


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 shards in place: nothing to unwrap)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective. Rank 0 gets every tensor unsharded on CPU (keys without DDP's `module.`);
    the other ranks get an empty dict."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)  # type: ignore[return-value]


def _detach_from_live(sd: dict[str, torch.Tensor], live: nn.Module) -> dict[str, torch.Tensor]:
    """Clone the entries that still share storage with the live model (an unsharded CPU
    model's "gathered" state dict is the parameters themselves), so that merging adapters into
    the export copy never changes the trained model."""
    live_ptrs = {
        t.untyped_storage().data_ptr()
        for t in [*live.parameters(), *live.buffers()]
        if not isinstance(t, DTensor) and t.device.type == "cpu"
    }
    return {
        k: v.clone() if v.untyped_storage().data_ptr() in live_ptrs else v for k, v in sd.items()
    }


def _fill_buffers(model: nn.Module, live: nn.Module) -> None:
    """Non-persistent buffers (rotary frequencies) are not in a state dict: copy them from the
    live model so that the export copy is a complete model, not one with meta tensors."""
    live_buffers = dict(live.named_buffers())
    for name, buf in list(model.named_buffers()):
        if buf.is_meta and name in live_buffers:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = live_buffers[name].detach().cpu().clone()


def plain_model(live: nn.Module, sd: dict[str, torch.Tensor], *, merge: bool) -> PreTrainedModel:
    """A plain CPU model built from the live model's config and the gathered state dict,
    without a second copy of the weights (meta init, then the gathered tensors are assigned).
    With `merge`, the live model is a PeftModel and the adapters are merged into the copy."""
    base = live.get_base_model() if merge else live  # type: ignore[operator]
    config = copy.deepcopy(base.config)
    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        if merge:
            from peft import get_peft_model

            peft_config = copy.deepcopy(live.peft_config["default"])  # type: ignore[index]
            model = get_peft_model(model, peft_config)  # type: ignore[arg-type]
    sd = _detach_from_live(sd, live) if merge else sd
    model.load_state_dict(sd, strict=True, assign=True)
    _fill_buffers(model, live)
    if merge:
        model = model.merge_and_unload()  # type: ignore[operator]
    assert isinstance(model, PreTrainedModel)
    model.tie_weights()  # assign=True replaced tied tensors by separate ones
    return model


def write_model(
    live: nn.Module,
    sd: dict[str, torch.Tensor],
    target: Path,
    *,
    method: MethodSpec,
    merge: bool,
) -> str:
    """Write weights and config into `target`; returns what was written."""
    if method.type == "full":
        plain_model(live, sd, merge=False).save_pretrained(target)
        return "model"
    from peft import PeftModel

    if not isinstance(live, PeftModel):
        raise TypeError(f"method.type {method.type} but the model is {type(live).__name__}")
    if merge:
        plain_model(live, sd, merge=True).save_pretrained(target)
        return "merged model"
    # The adapter alone: peft picks the LoRA tensors out of the gathered state dict; the live
    # model only provides the adapter config. No embedding layers: the vocabulary is unchanged.
    live.save_pretrained(
        str(target), state_dict=sd, safe_serialization=True, save_embedding_layers=False
    )
    return "adapter"


def write_marker(target: Path, meta: dict[str, Any]) -> None:
    (target / FINISHED_MARKER).write_text(json.dumps(meta, indent=1, sort_keys=True))


def remove_stale(root: Path, infix: str) -> list[Path]:
    """Leftovers of an earlier attempt next to `root` (`<name>.tmp-<step>`, `<name>.old-<step>`:
    only names this exporter makes, so a user's `<name>.tmp-notes` is never touched)."""
    pattern = f"{glob.escape(root.name)}{infix}*"
    stale = sorted(
        p for p in root.parent.glob(pattern) if p.name[len(root.name) + len(infix) :].isdigit()
    )
    for path in stale:
        remove(path)
    return stale


def publish(staged: Path, target: Location, step: int) -> None:
    """Put a complete export in place, replacing the previous one."""
    if target.is_local:
        _publish_by_rename(staged, target.local_path, step)
    else:
        _publish_by_upload(staged, target)


def _publish_by_upload(staged: Path, root: Location) -> None:
    """Object store: the marker goes first and comes last, so what readers see without it is
    an unfinished export, never a mix taken for a finished one."""
    (root / FINISHED_MARKER).remove()
    root.remove()
    files = sorted(p for p in staged.rglob("*") if p.is_file() and p.name != FINISHED_MARKER)
    for file in [*files, staged / FINISHED_MARKER]:
        (root / file.relative_to(staged).as_posix()).upload(file)
    shutil.rmtree(staged, ignore_errors=True)


def _publish_by_rename(staged: Path, root: Path, step: int) -> None:
    """A directory cannot be renamed over a non-empty one, so the old one is renamed aside
    first and deleted after."""
    old = root.with_name(f"{root.name}{_OLD_INFIX}{step}")
    if root.exists() or root.is_symlink():
        remove(old)
        os.replace(root, old)
    os.replace(staged, root)
    fsync_dir(root.parent)
    remove_stale(root, _OLD_INFIX)


class HfExporter:
    """Writes `spec.output` as a Hugging Face safetensors directory (see the module doc)."""

    def __init__(
        self,
        spec: OutputSpec,
        *,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        method: MethodSpec,
        rank: int,
        meta: dict[str, Any],
        cwd: Path | None = None,
        object_store: ObjectStoreSpec | None = None,
        gather: Callable[[], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        assert spec.uri is not None
        if spec.merge_lora and method.type == "qlora":
            raise UnsupportedConfigError(
                "output.mergeLora with method.type qlora is not implemented yet (the base "
                "weights are 4-bit); set mergeLora false to export the adapter"
            )
        self.root = resolve_output(spec.uri, cwd, object_store)
        # Refuse at start, not after hours of training, if the target is not ours to replace.
        check_output_target(self.root, meta, FINISHED_MARKER)
        self.spec = spec
        self.model = model
        self.tokenizer = tokenizer
        self.method = method
        self.rank = rank
        self.meta = meta
        # How the full state dict is gathered: the torch path's, or the backend's (DeepSpeed).
        self.gather = gather or (lambda: gather_full_state_dict(self.model))

    def export(self, step: int, *, loss: float | None = None) -> Location | None:
        t0 = time.monotonic()
        sd = self.gather()
        if self.rank != 0:
            # No barrier afterwards: rank 0 may write for longer than a collective timeout.
            return None
        gathered = time.monotonic() - t0
        merge = self.spec.merge_lora and self.method.type != "full"
        staged = _staging_dir_for(self.root, step)
        what = write_model(unwrap(self.model), sd, staged, method=self.method, merge=merge)
        del sd
        self.tokenizer.save_pretrained(staged)
        marker = {
            **self.meta,
            "step": step,
            "method": self.method.type,
            "mergeLora": merge,
            "content": what,
            "format": self.spec.format,
            "time": time.time(),
        }
        if loss is not None:
            marker["loss"] = loss
        write_marker(staged, marker)
        # Again at publish time: the directory may have been filled while we trained.
        try:
            check_output_target(self.root, self.meta, FINISHED_MARKER)
        except StorageRefusedError:
            remove(staged)
            raise
        publish(staged, self.root, step)
        log.info(
            "exported the %s at step %d to %s in %.2fs (gather %.2fs)",
            what,
            step,
            self.root,
            time.monotonic() - t0,
            gathered,
        )
        return self.root


def _staging_dir_for(root: Location, step: int) -> Path:
    """Beside the target on a volume (the rename stays on one filesystem); a local temp
    directory for an object store (the pod's /tmp: it needs room for one export)."""
    if not root.is_local:
        return Path(tempfile.mkdtemp(prefix=f"export-{step}-"))
    target = root.local_path
    target.parent.mkdir(parents=True, exist_ok=True)
    for path in remove_stale(target, _TMP_INFIX):
        log.warning("removed unfinished export %s", path)
    staged = target.with_name(f"{target.name}{_TMP_INFIX}{step}")
    staged.mkdir()
    return staged


def build_exporter(
    spec: OutputSpec | None,
    *,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    method: MethodSpec,
    rank: int,
    meta: dict[str, Any],
    object_store: ObjectStoreSpec | None = None,
    gather: Callable[[], dict[str, torch.Tensor]] | None = None,
) -> Exporter:
    if spec is None or not spec.uri:
        return NoOpExporter()
    return HfExporter(
        spec,
        model=model,
        tokenizer=tokenizer,
        method=method,
        rank=rank,
        meta=meta,
        object_store=object_store,
        gather=gather,
    )
