"""The caching-allocator (reserved) and step-time models calibrated on an H100
(bench/gpu.py, bench/results/gpu-h100.md): their structure, checked without a GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune_operator.planner import Candidate, TrainingShape, estimate_memory, shape_of
from finetune_operator.planner.catalog import lookup
from finetune_operator.planner.memory import ALLOCATOR_FRAGMENTATION
from finetune_operator.planner.steptime import flops_per_token, width_factor

LLAMA_1B = lookup("meta-llama/Llama-3.2-1B-Instruct")
LLAMA_8B = lookup("meta-llama/Llama-3.1-8B")
assert LLAMA_1B is not None and LLAMA_8B is not None
M1 = shape_of(LLAMA_1B.architecture)
M8 = shape_of(LLAMA_8B.architecture)
SHAPE = TrainingShape(micro_batch_size=2, seq_len=2048, checkpointing=True, grad_accumulation=4)


def test_ddp_reserves_the_compute_pool_only() -> None:
    est = estimate_memory(M1, SHAPE, Candidate("ddp"))
    assert est.breakdown.reserved == int(est.breakdown.peak * ALLOCATOR_FRAGMENTATION)


def test_fsdp_reserves_a_second_pool_for_the_sharded_gradients() -> None:
    """FSDP2 produces the sharded fp32 gradients on its reduce-scatter stream; freed at
    zero_grad, they stay cached in that stream's pool, which the compute stream never reuses."""
    b = estimate_memory(M1, SHAPE, Candidate("fsdp-full-shard")).breakdown
    assert b.gradients == M1.total * 4
    assert b.reserved >= int(b.peak * ALLOCATOR_FRAGMENTATION) + b.gradients - 1
    # Sharded over 8 ranks, the side pool shrinks with the gradients.
    b8 = estimate_memory(M1, SHAPE, Candidate("fsdp-full-shard", world_size=8)).breakdown
    assert b8.gradients == -(-M1.total // 8) * 4 and b8.reserved < b.reserved
    # CPU runs have no caching allocator pools per stream.
    cpu = estimate_memory(M1, SHAPE, Candidate("fsdp-full-shard", cuda=False)).breakdown
    assert cpu.reserved == int(cpu.peak * ALLOCATOR_FRAGMENTATION)


def test_fsdp_lora_side_pool_is_only_the_adapters() -> None:
    lora = replace(SHAPE, method="lora")
    b = estimate_memory(M8, lora, Candidate("fsdp-full-shard")).breakdown
    assert b.gradients < 2**30
    assert b.reserved - int(b.peak * ALLOCATOR_FRAGMENTATION) <= b.gradients


def test_flops_count_recomputation_attention_and_a_tied_head() -> None:
    plain = replace(SHAPE, checkpointing=False)
    assert flops_per_token(M8, SHAPE) == pytest.approx(flops_per_token(M8, plain) * 8 / 6)
    lora = replace(plain, method="lora")
    assert flops_per_token(M8, lora) == pytest.approx(flops_per_token(M8, plain) * 4 / 6)
    longer = replace(plain, seq_len=4096)
    assert flops_per_token(M8, longer) > flops_per_token(M8, plain)
    # Llama-3.2-1B ties its head to the embedding: the head's matmul still counts.
    assert M1.lm_head == 0
    assert flops_per_token(M1, plain) > 6 * (M1.total - M1.embedding)


def test_narrow_models_run_below_the_products_mfu() -> None:
    qwen = lookup("Qwen/Qwen2.5-0.5B")
    assert qwen is not None
    assert width_factor(shape_of(qwen.architecture)) < width_factor(M1) == width_factor(M8) == 1.0
