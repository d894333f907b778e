"""What a DeepSpeed ZeRO engine holds, by exact tensor accounting (used by deepspeed_memory.py).

`account(engine)` walks the engine's own object graph (its ZeRO optimizer's attributes, the
wrapped optimizer's `state`, the module's parameters with their `.grad` and ZeRO-3 `ds_tensor`)
and counts every distinct tensor storage once, under the first attribute path that reaches it.
Each storage is put in a component by that path (the DeepSpeed structure it belongs to) and
on the device or the host by where DeepSpeed allocates it on a GPU machine: on the CPU
accelerator everything is host memory, so the placement is read from DeepSpeed's source
(the structures listed in HOST_WHEN_OFFLOADED are allocated on `self.device`, which is "cpu"
under offload_optimizer; ZeRO-3's parameter partitions go to the host under offload_param).
Storages no rule names are reported as "other" with their paths, never dropped.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# (substring of the attribute path, component), first match wins; gradient rules come first
# because `.grad` of a master partition is a gradient, not a master weight.
RULES: tuple[tuple[str, str], ...] = (
    # Reduce buckets and offload staging buffers: communication, not model states.
    ("ipg_bucket", "buffers"),
    ("ipg_buffer", "buffers"),
    ("temp_grad_buffer_for", "buffers"),
    ("lp_param_contiguous_pin_buffer", "buffers"),
    ("extra_large_param_to_reduce", "buffers"),
    (".grad", "gradients"),
    ("grads_in_partition", "gradients"),
    ("averaged_gradients", "gradients"),
    ("all_grad_tensors", "gradients"),
    ("grad_partitions_flat_buffer", "gradients"),
    ("param_id_to_grad_partition", "gradients"),
    ("accumulated_grads_in_cpu", "gradients"),
    ("offload_gradient_dict", "gradients"),
    ("grad_accum", "gradients"),
    ("optimizer.state", "optimizer"),
    ("single_partition_of_fp32_groups", "master"),
    ("fp32_partitioned_groups_flat", "master"),
    # offload: the host e-byte partition the updated weights are copied back through.
    ("param_buffer_of_bit16_for_cpu_offload", "parameters"),
    ("bit16_groups", "parameters"),
    ("parallel_partitioned_bit16_groups", "parameters"),
    ("fp16_groups", "parameters"),
    ("fp16_partitioned_groups", "parameters"),
    ("lp_param_buffer", "parameters"),
    ("param_groups_fp16_flat_cpu_memory", "parameters"),
    ("ds_tensor", "parameters"),
    ("module.", "parameters"),
)
COMPONENTS = ("parameters", "gradients", "master", "optimizer", "buffers", "other")

# Allocated on `self.device` (== "cpu" under offload_optimizer) in stage_1_and_2.py/stage3.py:
# the fp32 master partition and its fp32 gradient, the optimizer's state (DeepSpeedCPUAdam
# steps on the host), the bf16 copy-back buffer, the host staging buffer for gradients,
# ZeRO-3's gradient partitions.
HOST_WHEN_OFFLOADED = (
    "single_partition_of_fp32_groups",
    "fp32_partitioned_groups_flat",
    "optimizer.state",
    "param_buffer_of_bit16_for_cpu_offload",
    "temp_grad_buffer_for_cpu_offload",
    "accumulated_grads_in_cpu",
    "grad_partitions_flat_buffer",
    "param_id_to_grad_partition",
)
# ZeRO-3 offload_param: the low-precision partitions live in pinned host memory.
HOST_WHEN_PARAMS_OFFLOADED = (
    "param_groups_fp16_flat_cpu_memory",
    "fp16_partitioned_groups",
    "lp_param_buffer",
    "ds_tensor",
)
OWNERS = (
    "bit16_groups_flat",
    "single_partition_of_fp32_groups",
    "lp_param_buffer",
    "param_groups_fp16_flat_cpu_memory",
    "fp16_partitioned_groups_flat",
    "fp32_partitioned_groups_flat",
    "grad_partitions_flat_buffer",
    "grads_in_partition",
    "optimizer",
)
_SKIP_TYPES = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)


@dataclass
class Accounting:
    """Bytes per (placement, component) and the paths behind each storage."""

    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    paths: dict[tuple[str, str], list[str]] = field(default_factory=lambda: defaultdict(list))

    def total(self, placement: str | None = None, component: str | None = None) -> int:
        return sum(
            v
            for (p, c), v in self.bytes.items()
            if (placement is None or p == placement) and (component is None or c == component)
        )


def classify(path: str) -> str:
    for key, component in RULES:
        if key in path:
            return component
    return "other"


def placement(path: str, offload_optimizer: bool, offload_param: bool) -> str:
    if offload_optimizer and any(k in path for k in HOST_WHEN_OFFLOADED):
        return "host"
    if offload_param and any(k in path for k in HOST_WHEN_PARAMS_OFFLOADED):
        return "host"
    return "device"


def _children(obj: Any, path: str) -> Iterator[tuple[Any, str]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, torch.Tensor):
                yield k, f"{path}.key"
            yield v, f"{path}[{k if isinstance(k, (str, int)) else type(k).__name__}]"
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield v, f"{path}[{i}]"
    elif isinstance(obj, torch.Tensor):
        if obj.grad is not None:
            yield obj.grad, f"{path}.grad"
        for k, v in getattr(obj, "__dict__", {}).items():
            if isinstance(v, torch.Tensor):
                yield v, f"{path}.{k}"
    elif isinstance(obj, torch.optim.Optimizer):
        # Only the state's values: its keys and param_groups are the ZeRO optimizer's own
        # master partitions, owned (and counted) there.
        for i, v in enumerate(obj.state.values()):
            yield v, f"{path}.state[{i}]"
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("deepspeed", "torch.optim")):
        for k, v in vars(obj).items():
            # Mangled private names (_DeepSpeedZeroOptimizer_Stage3__x) read as _x.
            yield v, f"{path}.{k.split('__', 1)[-1] if k.startswith('_Deep') else k}"


def account(engine: Any, offload_optimizer: bool, offload_param: bool) -> Accounting:
    """Every distinct storage the engine's optimizer and module reach, counted once."""
    acc = Accounting()
    seen_storage: set[int] = set()
    seen_obj: set[int] = set()
    opt = engine.optimizer
    # Owners first, so a tensor reached from several structures is named by the one that
    # allocates it (stage 1/2 model params are views into bit16_groups_flat).
    roots: list[tuple[Any, str]] = [
        (getattr(opt, a), f"opt.{a}") for a in OWNERS if hasattr(opt, a)
    ]
    roots += [(p, f"module.{n}") for n, p in engine.module.named_parameters()]
    roots += [(b, f"module.{n}") for n, b in engine.module.named_buffers()]
    roots.append((opt, "opt"))
    stack = list(reversed(roots))
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, (*_SKIP_TYPES, torch.nn.Module)) or id(obj) in seen_obj:
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() and key not in seen_storage:
                seen_storage.add(key)
                where = placement(path, offload_optimizer, offload_param)
                comp = "buffers" if path.endswith(".grad") and "buffer" in path else classify(path)
                acc.bytes[(where, comp)] += storage.nbytes()
                acc.paths[(where, comp)].append(path)
        stack.extend(reversed(list(_children(obj, path))))
    return acc
