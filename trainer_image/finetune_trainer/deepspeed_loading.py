"""DeepSpeed ZeRO-3 loading at scale: no rank ever holds the whole model.

1. Build under `deepspeed.zero.Init` with the job's DeepSpeed config: each module's
   parameters are allocated in the config's dtype (bf16/fp16/fp32) and partitioned over the
   ranks as soon as the module is constructed, on the accelerator or, with `offload: cpu`,
   on the host (`remote_device`: the config's `offload_param` device). Hugging Face's own
   random init is switched off meanwhile (it would run on empty partitions); tied heads are
   tied again afterwards, and the rotary buffers zero.Init created in the half dtype are put
   back to fp32 and recomputed.
2. Fill one module at a time under `deepspeed.zero.GatheredParameters(modifier_rank=0)`: the
   module's parameters are gathered whole (in the partition dtype) on every rank, rank 0
   writes them, DeepSpeed broadcasts rank 0's values and each rank keeps its partition.
   - Inline models: the torch path's seeded per-module init (finetune_trainer.materialize,
     fp32, seeded by job seed and module name), so a ZeRO-3 job starts from the same weights
     as a DDP/FSDP job of the same seed (in fp32; bf16/fp16 round them, as DeepSpeed's
     masters are made from the half-precision partitions).
   - Pretrained (safetensors): rank 0 reads the module's tensors (just those tensors'
     bytes: mapped from a local directory, by byte ranges requested together from an
     object-store prefix; finetune_trainer.remote_tensors); never a whole state dict. Every
     rank checks the headers, which rank 0 reads for all (a sharded checkpoint's index
     followed, a truncated file refused); the ranks together read the model once.
   Why modifier_rank=0 rather than every rank computing the same values: DeepSpeed keeps a
   change made under GatheredParameters only through a broadcast from the modifier rank
   (modifier_rank=None discards it), so the broadcast happens either way; with one modifier,
   only rank 0 pays the random generator or the file read, and the other ranks hold no fp32
   temporary.
3. LoRA (peft) adapters are created after the build, outside zero.Init: whole on every rank
   (they are small), initialised by the same seeded rule on every rank, cast to the
   partition dtype; `deepspeed.initialize` partitions them.

Per-rank load peak: the partitions plus one module gathered (partition dtype) plus, on rank 0,
that module in fp32 (finetune_operator.planner.loading)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedTokenizerBase

from finetune_operator.api.jobconfig import JobConfig
from finetune_trainer.deepspeed_engine import (
    cast_whole_parameters,
    check_supported,
    import_deepspeed,
    job_deepspeed_config,
    param_dtype,
)
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.location import Location, locate
from finetune_trainer.materialize import initialize
from finetune_trainer.model import build_meta_model, weights_source
from finetune_trainer.pretrained import checkpoint_keys, has_safetensors, hf_model
from finetune_trainer.remote_tensors import SafetensorsSource

log = logging.getLogger(__name__)

MODIFIER_RANK = 0


def _is_partitioned(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


@contextlib.contextmanager
def gather_for_init(params: list[nn.Parameter]) -> Iterator[bool]:
    """materialize.Gather for ZeRO-3: gather the partitioned `params` whole, yield whether
    this rank is the one whose values are kept (rank 0), re-partition on exit. Parameters
    that are not partitioned (peft's adapters before initialize) are whole on every rank
    already: every rank writes its own (seeded: identical)."""
    partitioned = [p for p in params if _is_partitioned(p)]
    if not partitioned:
        yield True
        return
    deepspeed = import_deepspeed()
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=MODIFIER_RANK):
        yield dist.get_rank() == MODIFIER_RANK


@contextlib.contextmanager
def partitioned_construction(config: dict[str, Any]) -> Iterator[None]:
    """Modules constructed in this context are partitioned as they are created (zero.Init
    with the job's `config`, its dtype and its parameter offload device)."""
    deepspeed = import_deepspeed()
    from transformers.initialization import no_init_weights

    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    offload = config.get("zero_optimization", {}).get("offload_param", {}).get("device")
    # Hugging Face's init skipped: it would write into empty partitions (and a padding row
    # index fails there); materialize's per-module init fills them instead.
    with (
        no_init_weights(),
        # dtype from the config (deepspeed_engine.param_dtype's rule), not the `dtype` argument: in
        # DeepSpeed 0.19.8 an explicit dtype is ignored on an accelerator without fp16 (the
        # CPU one), which gets bf16 whatever is asked (`Init._set_dtype`).
        deepspeed.zero.Init(
            config_dict_or_path=config,
            remote_device=offload if offload == "cpu" else None,
        ),
    ):
        yield


def _fp32_buffers(model: nn.Module) -> None:
    """zero.Init creates every floating tensor of the build in its dtype, buffers included
    (rotary inv_freq in bf16 would lose precision); the torch path keeps them fp32. Replaced
    by empty fp32 ones here, recomputed by the init pass."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                module._buffers[name] = torch.empty(
                    buf.shape, dtype=torch.float32, device=buf.device
                )


def _open_weights(weights: Path | Location) -> SafetensorsSource:
    """The safetensors of a directory or an object-store prefix, headers read and checked
    (one reader for both: the index followed, a truncated file refused naming it)."""
    if isinstance(weights, Path):
        if not has_safetensors(weights):
            raise UnsupportedConfigError(
                f"spec.model: no *.safetensors weights in {weights} (the trainer reads Hugging "
                "Face safetensors; convert .bin checkpoints with save_pretrained)"
            )
        weights = locate(str(weights.resolve()), "spec.model")
    # Every rank opens them (the fill is a sequence of collectives): rank 0 reads the headers.
    return SafetensorsSource(weights, shared=True)


def _check_shapes(names: dict[str, nn.Parameter], source: SafetensorsSource) -> None:
    # Checked on every rank from the headers, so a bad checkpoint fails every rank alike
    # (no rank left waiting in a gather).
    where = source.location.url
    for name, param in names.items():
        shape = source.shape(name)
        if shape is None:
            raise UnsupportedConfigError(
                f"spec.model: the weights in {where} have no tensor {name!r} of the model "
                "built from its config"
            )
        want = tuple(getattr(param, "ds_shape", param.shape))
        if shape != want:
            raise UnsupportedConfigError(
                f"spec.model: tensor {name!r} in {where} has shape {shape}, the model "
                f"built from its config {want}"
            )


def load_safetensors_zero3(model: nn.Module, weights: Path | Location) -> set[int]:
    """Read the base parameters of a ZeRO-3 partitioned `model` from the safetensors in
    `weights` (a directory, or an object-store prefix), one module at a time: rank 0 reads
    the module's tensors (from a prefix: its byte ranges, requested together), DeepSpeed
    broadcasts them, each rank keeps its partition. So the ranks together read each tensor
    once (and every rank the headers); returns the ids of the parameters filled."""
    names = checkpoint_keys(model)
    source = _open_weights(weights)
    _check_shapes(names, source)
    by_id = {id(p): name for name, p in names.items()}
    done: set[int] = set()
    for module in hf_model(model).modules():
        params = [
            p
            for p in module._parameters.values()
            if p is not None and id(p) in by_id and id(p) not in done
        ]
        if not params:
            continue
        with gather_for_init(params) as kept:
            done.update(id(p) for p in params)
            if kept:
                tensors = source.read([by_id[id(p)] for p in params])
                for p in params:
                    p.copy_(tensors.pop(by_id[id(p)]))
    log.info(
        "pretrained weights (ZeRO-3, rank %d): read %d of %d bytes from %s",
        dist.get_rank(),
        source.bytes_read,
        source.bytes_total,
        source.location.url,
        extra={"bytes_read": source.bytes_read, "bytes_total": source.bytes_total},
    )
    return done


def load_zero3_model(
    job: JobConfig,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    cache_dir: Path | None = None,
) -> nn.Module:
    """The job's model built partitioned under zero.Init and filled module by module (see
    the module docstring), ready for `deepspeed.initialize`; `cache_dir`: the pod's data
    cache, where an s3:// model's config is fetched to."""
    check_supported(job)
    spec = job.spec
    config, _ = job_deepspeed_config(job)
    model = build_meta_model(
        spec.model,
        spec.method,
        tokenizer,
        device,
        architecture=spec.model.architecture or job.plan.architecture,
        activation_checkpointing=job.plan.activation_checkpointing,
        precision=spec.training.precision,
        construct_in=partitioned_construction(config),
        object_store=spec.storage.object_store,
        cache_dir=cache_dir,
    )
    # The build's tie was skipped with the init (no_init_weights); the head's own partition
    # is dropped with it.
    hf_model(model).tie_weights()  # type: ignore[operator]
    _fp32_buffers(model)
    weights = weights_source(spec.model, spec.storage.object_store)
    devices = [device] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        done = load_safetensors_zero3(model, weights) if weights is not None else set()
        initialize(model, device, seed=spec.training.seed, done=done, gather=gather_for_init)
    # The engine casts nothing of a zero.Init model: parameters created outside it (the
    # adapters) are given the partitions' dtype here, as the engine gives a materialised one.
    cast_whole_parameters(model, param_dtype(config))
    return model
