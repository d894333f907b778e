"""Pretrained Hugging Face weights (safetensors) read straight into a model's shards.

DCP plans the read like a checkpoint load: each rank asks only for the slices its DTensor
shards cover, and our storage reader (finetune_trainer.safetensors_ranges, over fsspec: a
local directory or an object-store prefix alike) reads just the dim-0 rows of those slices by
byte ranges, so no rank ever holds a whole tensor it does not own. Under DDP the parameters
are plain tensors and every rank reads them whole (a full replica is what DDP is). The
checkpoint's dtype is converted on copy (bf16 on disk into fp32 masters for full
fine-tuning). A sharded checkpoint's model.safetensors.index.json decides which file each
tensor is read from."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.location import Location, access_problem, locate
from finetune_trainer.ranged_reads import GAP_BYTES, is_transient
from finetune_trainer.safetensors_ranges import RangedSafetensorsReader

log = logging.getLogger(__name__)

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


def load_safetensors(model: nn.Module, weights: Path | Location) -> set[int]:
    """Read every base parameter of `model` from the safetensors in `weights` (a directory, or
    an object-store prefix); returns the ids of the parameters filled. A missing or
    mis-shaped tensor is an error naming the model."""
    if isinstance(weights, Path):
        if not has_safetensors(weights):
            raise UnsupportedConfigError(
                f"spec.model: no *.safetensors weights in {weights} (the trainer reads Hugging "
                "Face safetensors; convert .bin checkpoints with save_pretrained)"
            )
        # One reader for a directory and a prefix: torch's HuggingFaceStorageReader reads
        # every *.safetensors and lets a stale shard's copy of a tensor win silently; ours
        # follows model.safetensors.index.json (finetune_trainer.safetensors_index).
        weights = locate(str(weights.resolve()), "spec.model")
    return _load_ranged(model, weights)


def _underlying(exc: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (else `exc`)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        cause = first[0] if isinstance(first, tuple) else first
        return cause if isinstance(cause, BaseException) else exc
    return exc


def weights_error(weights: Location, cause: BaseException, into: str = "") -> Exception:
    """A failed read of pretrained weights as the trainer reports it (every loader: this
    module's, remote_tensors', replica_loading's): a refusal naming the URI for what a restart
    cannot change (no such bucket, denied, not safetensors, truncated), else a RuntimeError (a
    short read, the network, throttling, each range already retried, or expired credentials:
    a restart may pass). A CheckpointException is judged by the error inside it: on a rank
    whose own read went well it holds another rank's (a short read there is no refusal)."""
    cause = _underlying(cause)
    if is_transient(cause) or (isinstance(cause, OSError) and access_problem(cause) is None):
        return RuntimeError(f"reading the weights under {weights.url}: {cause}")
    problem = access_problem(cause) or str(cause)
    return UnsupportedConfigError(
        f"spec.model: cannot read the weights under {weights.url}{into}: {problem}"
    )


def _load_ranged(model: nn.Module, weights: Location) -> set[int]:
    try:
        found = any(e.name.endswith(".safetensors") for e in weights.children())
    except OSError as e:
        problem = access_problem(e)
        if problem is None:  # the network, throttling, expired credentials: a restart may pass
            raise RuntimeError(f"listing the weights under {weights.url}: {e}") from e
        raise UnsupportedConfigError(f"spec.model: {weights.url}: {problem}") from e
    if not found:
        raise UnsupportedConfigError(
            f"spec.model: no *.safetensors objects under {weights.url} (the trainer reads "
            "Hugging Face safetensors; convert .bin checkpoints with save_pretrained)"
        )
    params = checkpoint_keys(model)
    state: dict[str, torch.Tensor] = dict(params)
    # The coalescing gap: FT_RANGE_GAP_BYTES=-1 asks for one request per range (the bench's
    # baseline; a store that bills by the byte rather than by the request).
    gap = int(os.environ.get("FT_RANGE_GAP_BYTES", GAP_BYTES))
    # Inside dcp.load on the default group every rank reads the metadata: rank 0 for all.
    reader = RangedSafetensorsReader(weights, gap_bytes=gap, shared=True)
    try:
        dcp.load(state, storage_reader=reader)
    except (Exception, CheckpointException) as exc:
        cause = reader.failure or exc
        raise weights_error(weights, cause, " into the model built from its config") from exc
    log.info(
        "pretrained weights: read %d of %d bytes from %s (in %d requests; %d bytes of gaps "
        "between coalesced ranges and %d of index fetched besides)",
        reader.bytes_read,
        reader.bytes_total,
        weights.url,
        reader.requests,
        reader.bytes_gaps,
        reader.bytes_index,
        extra={
            "bytes_read": reader.bytes_read,
            "bytes_total": reader.bytes_total,
            "bytes_gaps": reader.bytes_gaps,
            "bytes_index": reader.bytes_index,
            "requests": reader.requests,
        },
    )
    return {id(p) for p in params.values()}
