"""Materialise a model built on the meta device, after it was sharded: allocate each rank's
shards, then fill them one module at a time.

Why module by module from full tensors: every module's parameters are initialised as a whole
(fp32, on the training device, with a generator seeded from the job's seed and the module's
name) and each rank copies out only its own slice. A rank therefore never holds more than its
shards plus one module's full tensors, and the weights do not depend on the world size or the
strategy: DDP, FSDP at 2 or at 4 ranks and a plain single-process build start from the same
model, which keeps resumes and tests comparable. The cost is that each rank runs the random
generator over the whole model (cheap next to reading it from disk).

The rules are the Hugging Face model's own `_init_weights` (per family: norms, embeddings with
their padding row, rotary `inv_freq` buffers, which `to_empty` leaves as garbage) and peft's
`reset_lora_parameters` for adapters (A kaiming-uniform, B zero). Pretrained weights are read
first (finetune_trainer.pretrained) and skipped here."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from finetune_trainer.location import Location
from finetune_trainer.pretrained import hf_model, load_safetensors

INIT_DTYPE = torch.float32

# How a module's parameters are made whole while it is initialised: a context over the
# parameters that yields whether this rank's values are the ones kept. Plain and FSDP
# parameters need nothing (`_local`: every rank writes its own slice); ZeRO-3's partitioned
# ones are gathered and re-partitioned around it (deepspeed_loading.gather_for_init).
Gather = Callable[[list[nn.Parameter]], AbstractContextManager[bool]]
# How the pretrained weights are read into the allocated parameters; returns the ids filled.
# DeepSpeed ZeRO-1/2 replicas read an object-store prefix in stripes (replica_loading).
Load = Callable[[nn.Module, Path | Location], set[int]]


@contextmanager
def _local(params: list[nn.Parameter]) -> Iterator[bool]:
    yield True


def _lora_adapters(module: nn.Module) -> list[str]:
    lora_a = getattr(module, "lora_A", None)
    if isinstance(module, nn.Module) and hasattr(module, "reset_lora_parameters") and lora_a:
        return list(lora_a.keys())
    return []


def _module_seed(seed: int, name: str) -> int:
    # Names are those of the HF model without peft's wrapping (`q_proj.base_layer` is
    # `q_proj`), so a LoRA and a full build of the same seed share the base weights.
    name = name.replace(".base_layer", "")
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` into `param` (a DTensor shard or a plain tensor)."""
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            full.shape, param.device_mesh, param.placements
        )
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        param.to_local().copy_(full[index])
    else:
        param.copy_(full)


@contextmanager
def _full_params(
    modules: list[nn.Module], device: torch.device, done: set[int]
) -> Iterator[list[tuple[nn.Module, str, nn.Parameter, torch.Tensor]]]:
    """Swap the direct parameters of `modules` for full fp32 temporaries; on exit, copy the
    temporaries of the parameters not in `done` into the real ones and put those back."""
    swapped: list[tuple[nn.Module, str, nn.Parameter, torch.Tensor]] = []
    for module in modules:
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            full = torch.empty(param.shape, dtype=INIT_DTYPE, device=device)
            swapped.append((module, name, param, full))
            module._parameters[name] = nn.Parameter(full, requires_grad=False)
    try:
        yield swapped
    finally:
        for module, name, param, _ in swapped:
            module._parameters[name] = param
    for _, _, param, full in swapped:
        if id(param) not in done:
            copy_into(param, full)
            done.add(id(param))


def _needs_init(module: nn.Module, done: set[int]) -> bool:
    params = [p for p in module._parameters.values() if p is not None]
    has_buffers = any(b is not None for b in module._buffers.values())
    return has_buffers or any(id(p) not in done for p in params)


def _direct_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    return [p for m in modules for p in m._parameters.values() if p is not None]


def initialize(
    model: nn.Module, device: torch.device, *, seed: int, done: set[int], gather: Gather = _local
) -> None:
    """Fill every parameter not in `done` (ids) and every buffer, module by module, each one
    made whole by `gather` around its initialisation (see `Gather`). A rank whose values are
    not kept skips the random init of parameters (the kept rank's replace them); buffers are
    never partitioned, so every rank computes those."""
    base = hf_model(model)
    init_weights = base._init_weights  # type: ignore[operator]
    for name, module in base.named_modules():
        adapters = _lora_adapters(module)
        if adapters:
            # The adapter layer first: its reset gives A and B their rules (B zero), and
            # marks them done before the plain nn.Linear children come up in this walk.
            owners = [
                m
                for adapter in adapters
                for m in (module.lora_A[adapter], module.lora_B[adapter])  # type: ignore[index]
            ]
            with gather(_direct_params(owners)) as kept:
                if not kept:
                    done.update(id(p) for p in _direct_params(owners))
                else:
                    torch.manual_seed(_module_seed(seed, name + ".lora"))
                    with _full_params(owners, device, done):
                        for adapter in adapters:
                            module.reset_lora_parameters(adapter, True)  # type: ignore[operator]
        if not _needs_init(module, done):
            continue
        has_buffers = any(b is not None for b in module._buffers.values())
        with gather(_direct_params([module])) as kept:
            if not (kept or has_buffers):
                done.update(id(p) for p in _direct_params([module]))
                continue
            torch.manual_seed(_module_seed(seed, name))
            with _full_params([module], device, done):
                init_weights(module)


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Parameters registered on several modules (tied embeddings), by owner."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    # `to_empty` gives every module its own new Parameter (meta tensors cannot change device
    # in place), which silently unties a tied head; FSDP2 keeps them shared, plain modules
    # do not.
    for (first, first_name), *others in groups:
        param = first._parameters[first_name]
        for module, name in others:
            module._parameters[name] = param


def materialize(
    model: nn.Module,
    device: torch.device,
    *,
    seed: int,
    weights: Path | Location | None = None,
    load: Load = load_safetensors,
) -> None:
    """Allocate `model`'s meta (possibly sharded) tensors on `device`, read the pretrained
    `weights` (a Hugging Face safetensors directory or object-store prefix) into them when
    given, and initialise the
    rest (all of an inline model; the adapters of a pretrained one). The global RNG is left as
    it was, so training's random streams do not depend on how the model was built."""
    shared = _shared_parameters(model)
    model.to_empty(device=device)
    _retie(shared)
    devices = [device] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        done = load(model, weights) if weights is not None else set()
        initialize(model, device, seed=seed, done=done)
