"""Accelerator facts and per-process overheads the planner assumes, each with its source.

Everything here is a named constant so a reviewer can check or replace one number without
reading the memory model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from finetune_operator.api.quantity import UNITS
from finetune_operator.api.spec import ResourcesSpec
from finetune_operator.planner.errors import PlanningError

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class Accelerator:
    """One process's device: usable memory, dense bf16 peak and the links between devices."""

    name: str
    memory_bytes: int
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s (vendor datasheets, no sparsity)
    intra_node_bw: float  # achieved all-reduce bus bandwidth inside a node, bytes/s
    mfu: float  # achieved share of peak_flops of a fine-tuning step at hidden size >= 4096
    cuda: bool = True


# Achieved NCCL bus bandwidths (nccl-tests all_reduce_perf busbw, large messages): NVLink4
# (H100/H200 SXM) ~360 GB/s, NVLink3 (A100 SXM) ~230 GB/s, PCIe Gen4 without NVLink ~20 GB/s.
NVLINK4_BW = 360e9
NVLINK3_BW = 230e9
PCIE_BW = 20e9
# Inter-node: one 400 Gb/s InfiniBand/RoCE NIC per GPU reaches ~45 GB/s busbw in nccl-tests;
# we assume that fabric for multi-node jobs (a slower Ethernet fabric only makes comm dearer).
INTER_NODE_BW = 45e9
# MFU of HF-style fine-tuning with FSDP/ZeRO (TorchTitan and MosaicML reports: 35-50% on
# H100/A100 for 7B-70B Llama). Consumer and inference cards reach less.
MFU_DATACENTER = 0.40
MFU_OTHER = 0.30
# Measured on one H100 80GB (bench/gpu.py; bench/results/gpu-h100.md): the trainer's hardware
# FLOP rate (recomputation and causal attention counted) is 0.34-0.48 of the dense bf16 peak
# (median 0.42) from hidden size 2048 to 4096, less on narrower models (steptime.width_factor).
MFU_H100 = 0.42

# Memory in GiB is what `nvidia-smi` reports as total (e.g. H100 80GB = 81559 MiB).
GPU_PRODUCTS: dict[str, Accelerator] = {
    a.name.lower(): a
    for a in (
        Accelerator("H100-80GB", 81559 * MIB, 989e12, NVLINK4_BW, MFU_H100),
        Accelerator("H100-94GB", 95830 * MIB, 835e12, PCIE_BW * 3, MFU_DATACENTER),
        Accelerator("H200-141GB", 143771 * MIB, 989e12, NVLINK4_BW, MFU_DATACENTER),
        Accelerator("B200-180GB", 183359 * MIB, 2250e12, 2 * NVLINK4_BW, MFU_DATACENTER),
        Accelerator("A100-80GB", 81920 * MIB, 312e12, NVLINK3_BW, MFU_DATACENTER),
        Accelerator("A100-40GB", 40960 * MIB, 312e12, NVLINK3_BW, MFU_DATACENTER),
        Accelerator("L40S", 46068 * MIB, 362e12, PCIE_BW, MFU_OTHER),
        Accelerator("L4", 23034 * MIB, 121e12, PCIE_BW, MFU_OTHER),
        Accelerator("A10G", 23028 * MIB, 70e12, PCIE_BW, MFU_OTHER),
        Accelerator("A6000", 49140 * MIB, 155e12, PCIE_BW, MFU_OTHER),
        Accelerator("V100-32GB", 32768 * MIB, 125e12, NVLINK3_BW / 2, MFU_OTHER),
        Accelerator("T4", 15360 * MIB, 65e12, PCIE_BW, MFU_OTHER),
        Accelerator("RTX-4090", 24564 * MIB, 165e12, PCIE_BW, MFU_OTHER),
        Accelerator("RTX-3090", 24576 * MIB, 71e12, PCIE_BW, MFU_OTHER),
        Accelerator("MI300X", 196592 * MIB, 1307e12, NVLINK4_BW, MFU_OTHER),
    )
}
_PRODUCT_ALIASES = {
    "h100": "h100-80gb",
    "h200": "h200-141gb",
    "b200": "b200-180gb",
    "a100": "a100-80gb",
    "rtx4090": "rtx-4090",
    "4090": "rtx-4090",
    "rtx3090": "rtx-3090",
    "a10": "a10g",
    "v100": "v100-32gb",
}

# When only memoryGiB is given: assume a datacenter GPU of H100 speed over NVLink.
UNKNOWN_GPU_FLOPS = 989e12
# A CPU (gloo) process: ~50 GFLOP/s of fp32 matmul per process on a few cores (measured order
# of magnitude for torch CPU GEMM), loopback/TCP ~1 GB/s between processes.
CPU_FLOPS = 50e9
CPU_BW = 1e9

# What the GPU holds besides tensors (measured orders with torch 2.x, CUDA 12, lazy loading):
# the CUDA context with torch kernels ~500 MiB; cuBLAS workspaces (torch default
# CUBLAS_WORKSPACE_CONFIG, 32 MiB per stream on Hopper, a few streams) ~64 MiB; NCCL
# communicator buffers (NCCL_BUFFSIZE 4 MiB x channels x peers) ~256 MiB per process group.
CUDA_CONTEXT_BYTES = 500 * MIB
CUBLAS_WORKSPACE_BYTES = 64 * MIB
NCCL_BUFFER_BYTES = 256 * MIB

# Host RAM per GPU when an offloading job leaves resources.memory unset: an 8-GPU
# H100/A100 server (DGX H100) has 2 TiB, i.e. ~240 GiB per GPU after the OS.
DEFAULT_HOST_BYTES_PER_GPU = 240 * GIB

# Host RAM a process holds before its first tensor: Python, torch, the libraries and their
# heaps. Measured as peak RSS (VmHWM in /proc/self/status) on this repo's image (torch
# 2.13+cpu): the pod's torchrun agent after `import finetune_trainer.launch` 222 MiB (one per
# pod); a trainer after importing what it imports at start (finetune_trainer.trainer,
# transformers' Llama, peft, deepspeed) 379 MiB. A CUDA build maps more (libtorch_cuda, cuDNN,
# NCCL; not measured here), so on a GPU these are a floor. The plan adds them to what each
# process needs on the host, so a resources.memory the runtime alone exceeds is refused by the
# plan instead of the pod being OOM-killed at start.
AGENT_RUNTIME_HOST_BYTES = 224 * MIB
TRAINER_RUNTIME_HOST_BYTES = 384 * MIB


def runtime_host_bytes(gpus_per_node: int) -> int:
    """Host RAM one process needs before any tensor: its own runtime and its share of the
    pod's torchrun agent (the plan budgets per process: resources.memory / processes)."""
    return TRAINER_RUNTIME_HOST_BYTES + -(-AGENT_RUNTIME_HOST_BYTES // max(1, gpus_per_node))


# Kubernetes' resource.Quantity grammar, as ParseQuantity reads it: an optional "+" (a negative
# request is refused by pod validation), one number with at most one point, then either a decimal
# exponent with an integer power ("1e3", "2E-3") or one suffix: binary Ki..Ei or decimal n, u, m,
# "", k, M..E. Nothing else: no spaces, no "K" (only "k"), no exponent with a suffix ("1e3Gi"),
# which the API server refuses on every worker pod the operator would then create.
_QUANTITY = re.compile(
    r"^\+?(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<exponent>[eE][-+]?[0-9]+)|(?P<suffix>[KMGTPE]i|[numkMGTPE]))?$"
)
# Kubernetes reads a quantity's value as an int64 (Quantity.Value() saturates above it).
MAX_QUANTITY_BYTES = (1 << 63) - 1
# The byte suffixes of api.quantity, plus the sub-unit ones a memory request may also say
# (Kubernetes accepts "500m" even for bytes).
_UNITS: dict[str, float] = {**UNITS, "m": 1e-3, "u": 1e-6, "n": 1e-9}


# What people write for a memory size that Kubernetes spells otherwise: "16GB", "16gb", "16GiB",
# "16 Gi", "1K" (one number, one size prefix, an optional "i" and "B").
_UNIT_SLIP = re.compile(
    r"^\s*(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<prefix>[kmgtpe])(?:i?b|i)?\s*$", re.I
)


def _unit_hint(text: str) -> str:
    """'; did you mean '16Gi' (...) or '16G'?' for a memory size in another notation: the
    refusal then says what to write, not only that it is wrong."""
    slip = _UNIT_SLIP.match(text)
    if not slip:
        return ""
    number, prefix = slip["number"], slip["prefix"].upper()
    power = "KMGTPE".index(prefix) + 1
    decimal = "k" if prefix == "K" else prefix  # Kubernetes' decimal kilo is lower-case only
    return (
        f"; did you mean '{number}{prefix}i' ({number} x 2^{10 * power} bytes) or "
        f"'{number}{decimal}' ({number} x 10^{3 * power})?"
    )


def parse_quantity(text: str, field: str) -> int:
    """A Kubernetes memory quantity ('2Gi', '512M', '1e9') in bytes."""
    match = _QUANTITY.match(text)
    if not match:
        raise PlanningError(
            field, f"{text!r} is not a Kubernetes quantity such as 2Gi{_unit_hint(text)}"
        )
    number, exponent, suffix = match.group("number", "exponent", "suffix")
    value = float(number + (exponent or "")) * _UNITS[suffix or ""]
    if not value <= MAX_QUANTITY_BYTES:  # also infinity ("1e999")
        raise PlanningError(
            field, f"{text!r} is too large for a memory quantity (at most 2^63 - 1 bytes)"
        )
    return int(value)


def check_cpu_quantity(text: str, field: str) -> None:
    """Refuse a cpu the API server would refuse on every worker pod (the job would plan, then
    never start a worker): here it is refused before anything is created, naming the field."""
    if not _QUANTITY.match(text):
        raise PlanningError(field, f"{text!r} is not a Kubernetes quantity such as 8 or 500m")


def product(name: str) -> Accelerator | None:
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    key = _PRODUCT_ALIASES.get(key, key)
    return GPU_PRODUCTS.get(key) or GPU_PRODUCTS.get(key.replace("-", ""))


def accelerator_for(res: ResourcesSpec) -> Accelerator:
    """The device one process trains on, from resources (memoryGiB overrides the table)."""
    if res.device == "cpu":
        if res.memory is None:
            raise PlanningError(
                "spec.resources.memory", "a CPU job needs resources.memory (per pod) as its budget"
            )
        per_proc = parse_quantity(res.memory, "spec.resources.memory") // res.gpus_per_node
        if per_proc < 1:  # nothing fits in nothing, and every ratio to it is undefined
            raise PlanningError(
                "spec.resources.memory",
                f"{res.memory!r} over {res.gpus_per_node} process(es) per pod is less than "
                "one byte each: give the pod its memory, e.g. 2Gi",
            )
        return Accelerator("cpu", per_proc, CPU_FLOPS, CPU_BW, 1.0, cuda=False)
    known = product(res.gpu.product) if res.gpu.product else None
    if res.gpu.product and known is None and res.gpu.memory_gib is None:
        names = ", ".join(a.name for a in GPU_PRODUCTS.values())
        raise PlanningError(
            "spec.resources.gpu.product",
            f"unknown GPU product {res.gpu.product!r}; known: {names}; "
            "or set spec.resources.gpu.memoryGiB",
        )
    if known is None and res.gpu.memory_gib is None:
        raise PlanningError(
            "spec.resources.gpu", "set spec.resources.gpu.product (e.g. H100-80GB) or memoryGiB"
        )
    base = known or Accelerator("memoryGiB", 0, UNKNOWN_GPU_FLOPS, NVLINK4_BW, MFU_DATACENTER)
    mem = int(res.gpu.memory_gib * GIB) if res.gpu.memory_gib else base.memory_bytes
    if mem < 1:  # a positive memoryGiB can still be under a byte (1e-12)
        raise PlanningError(
            "spec.resources.gpu.memoryGiB", f"{res.gpu.memory_gib:g} GiB is less than one byte"
        )
    name = base.name if known else f"{mem / GIB:g}GiB"
    return Accelerator(name, mem, base.peak_flops, base.intra_node_bw, base.mfu)


def host_bytes_per_process(res: ResourcesSpec) -> int:
    """Host RAM one process may use: its runtime, offloaded states, a resume's read group."""
    if res.memory:
        return parse_quantity(res.memory, "spec.resources.memory") // res.gpus_per_node
    return DEFAULT_HOST_BYTES_PER_GPU
