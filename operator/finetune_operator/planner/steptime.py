"""A coarse optimizer-step time model, used to rank configurations that fit and to report a
plan's expected step time.

compute = hardware FLOPs / (N * peak * MFU * width_factor). Hardware FLOPs per token:
k * (P_active - input embedding) for the matmuls (the embedding is a lookup) plus k * layers * seq *
heads * head_dim for causal attention (half of QK^T and PV: flash/SDPA kernels skip the masked
half), k = 6 for full fine-tuning (forward 2, backward 4), 4 for LoRA/QLoRA (no weight
gradients of the frozen base), and the forward once more (k + 2) / k when every layer is
recomputed. Narrow models run smaller, less efficient matmuls: width_factor. Communication is
the ring volume per GPU of each strategy's collectives over the slowest link it crosses,
partly hidden behind compute. Calibrated on an H100 (hardware.MFU_H100,
bench/results/gpu-h100.md): within 15% on 6 of 7 measured configurations.
"""

from __future__ import annotations

from finetune_operator.planner.architecture import ModelShape
from finetune_operator.planner.configuration import PRECISION_BYTES, Candidate, TrainingShape
from finetune_operator.planner.hardware import INTER_NODE_BW, Accelerator
from finetune_operator.planner.lora import adapter_parameters, qlora_base_bytes

# Hidden size from which the matmuls reach the product's full MFU; below it efficiency falls
# as (h / WIDE_HIDDEN)^0.75 (H100: 0.39-0.48 of peak from h=2048 to 4096, 0.23 at h=896).
WIDE_HIDDEN = 2048
# bnb NF4 dequantisation on every forward and backward matmul: QLoRA runs ~30-40% slower
# than LoRA in the QLoRA paper and bnb benchmarks; we take 1/0.65.
QLORA_SLOWDOWN = 1 / 0.65
# Share of communication hidden behind compute (FSDP prefetch, DDP bucketing overlap).
COMM_OVERLAP = 0.6
# Kernel launches, Python and data loading per micro-batch (independent of its size): makes
# larger micro-batches win when everything else is equal.
PER_MICROBATCH_OVERHEAD_S = 0.005
# Offload: states cross PCIe Gen4/5 (~20 GB/s achieved per GPU) and DeepSpeed CPU-Adam
# updates ~1e9 parameters/s per process.
HOST_LINK_BW = 20e9
CPU_ADAM_PARAMS_PER_S = 1e9


def _comm_bytes(m: ModelShape, shape: TrainingShape, cand: Candidate) -> tuple[float, float]:
    """(intra-shard-group, cross-node replica) bytes each GPU sends per optimizer step."""
    e = PRECISION_BYTES[shape.precision]
    full = shape.method == "full"
    trainable = m.total if full else adapter_parameters(m, shape.lora_rank, shape.lora_targets)
    grads = trainable * (e if full else 4)
    params = m.total * e if shape.method != "qlora" else qlora_base_bytes(m, e)
    n, s, ga = cand.world_size, cand.shard_size, shape.grad_accumulation
    if n == 1:
        return 0.0, 0.0
    ring = (n - 1) / n
    row = cand.row  # what is sharded decides the collectives (api.strategies)
    if row.replicated:  # DDP: all-reduce the grads once per step
        return 2 * ring * grads, 0.0
    if not row.shards_params:
        # ZeRO-1: reduce-scatter the grads once per step; ZeRO-2 reduce-scatters every
        # micro-batch into its grad partitions. Both all-gather the updated trainable
        # parameters, in their own dtype (LoRA adapters are fp32, like their grads).
        reduce = ga * grads if row.shards_grads else grads
        return ring * (reduce + grads), 0.0
    if not row.reshard_after_forward:  # gathered once per micro-batch, kept for backward
        return ga * ring * (params + grads), 0.0
    if row.shard_within_node:
        ring_s = (s - 1) / s
        replicas = n // s
        return ga * ring_s * (2 * params + grads), 2 * (replicas - 1) / replicas * grads / s
    return ga * ring * (2 * params + grads), 0.0  # zero3 / fsdp-full-shard


def flops_per_token(m: ModelShape, shape: TrainingShape) -> float:
    """Hardware FLOPs per trained token (recomputation included), see the module docstring."""
    k = 6 if shape.method == "full" else 4
    a = m.arch
    head_dim = a.head_dim or a.hidden_size // a.num_attention_heads
    attention = k * a.num_hidden_layers * shape.seq_len * a.num_attention_heads * head_dim
    # The input embedding is a lookup; a tied head is the same matrix used as a matmul.
    matmul = m.active - (m.embedding if m.lm_head else 0)
    model = k * matmul + attention
    return model * ((k + 2) / k if shape.checkpointing else 1.0)


def width_factor(m: ModelShape) -> float:
    return float(min(1.0, m.arch.hidden_size / WIDE_HIDDEN) ** 0.75)


def step_seconds(
    m: ModelShape, shape: TrainingShape, cand: Candidate, acc: Accelerator, global_batch: int
) -> float:
    """Modelled wall time of one optimizer step (all micro-batches, all ranks in parallel)."""
    tokens = global_batch * shape.seq_len
    flops = flops_per_token(m, shape) * tokens
    compute = flops / (cand.world_size * acc.peak_flops * acc.mfu * width_factor(m))
    if shape.method == "qlora":
        compute *= QLORA_SLOWDOWN
    intra, cross = _comm_bytes(m, shape, cand)
    multi_node = cand.world_size > cand.gpus_per_node
    link = min(acc.intra_node_bw, INTER_NODE_BW) if multi_node else acc.intra_node_bw
    if cand.row.shard_within_node:
        comm = intra / acc.intra_node_bw + cross / min(acc.intra_node_bw, INTER_NODE_BW)
    else:
        comm = (intra + cross) / link
    offload = 0.0
    if cand.offloads:
        shard = m.total / cand.shard_size
        offload = 2 * shard * PRECISION_BYTES[shape.precision] / HOST_LINK_BW
        offload += shard / CPU_ADAM_PARAMS_PER_S
    overhead = PER_MICROBATCH_OVERHEAD_S * shape.grad_accumulation
    return compute + (1 - COMM_OVERLAP) * comm + offload + overhead
