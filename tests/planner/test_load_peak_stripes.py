"""plan.loadPeakBytes counts the stripes a replicated rank (DDP, ZeRO-1/2) holds while it
reads pretrained weights from an object store (finetune_trainer.replica_loading): one DCP
load's stripes, plus the raw reads in flight (the gathers are in place). The figure counted
before (the replica plus one module's fp32 init) left them out. On a GPU the stripes are on
the device and the raw reads in host memory: loadPeakBytes keeps the stripes, the search
counts the reads in the host RAM a process needs (Evaluated.load_host_bytes)."""

from __future__ import annotations

from typing import Any

import pytest
from planner_specs import make_spec

from finetune_operator.api.weights_reads import READ_BATCH_BYTES, READ_PART_BYTES, STRIPE_BYTES
from finetune_operator.planner import plan_job, shape_of
from finetune_operator.planner.loading import (
    largest_module_parameters,
    ranged_read_bytes,
    stripe_group_bytes,
    striped_read_bytes,
)
from finetune_operator.planner.planning import build_problem
from finetune_operator.planner.search import evaluate, strategies_for

MiB, GiB = 1 << 20, 1 << 30


def test_striped_read_bytes() -> None:
    # An 8B model's bf16 replica over 8 ranks (its 1 GiB embedding's stripe under the cap):
    # 256 MiB of stripes, and the fp32 bytes of those stripes in flight, up to the batch cap,
    # plus the S3 client's join of one GET (a part: bench/read_peak.py measures it).
    raw = READ_BATCH_BYTES + READ_PART_BYTES
    assert striped_read_bytes(16 * GiB, GiB, 8, element_bytes=2) == STRIPE_BYTES + raw
    # A small fp32 replica: its whole stripe (1/4) is one load; raw reads as large.
    small = striped_read_bytes(400 * MiB, 40 * MiB, 4, element_bytes=4)
    assert small == 100 * MiB + 100 * MiB + 64 * MiB
    # One tensor's stripe larger than the cap goes alone; the raw reads stay within the batch.
    assert striped_read_bytes(8 * GiB, 4 * GiB, 2, element_bytes=4) == 2 * GiB + raw
    assert striped_read_bytes(16 * GiB, GiB, 1, element_bytes=2) == 0  # one rank reads whole


def spec_of(source: dict[str, Any], strategy: dict[str, str]) -> Any:
    return make_spec(
        model={"name": "meta-llama/Llama-2-7b-hf", **source},
        method={"type": "lora"},
        strategy=strategy,
        resources={"gpusPerNode": 8, "maxGPUs": 8},
        storage={"objectStore": {"region": "us-east-1"}},
    )


S3 = {"source": "uri", "path": "s3://models/llama-2-7b"}
HUB: dict[str, str] = {}


@pytest.mark.parametrize(
    "strategy",
    [{"type": "ddp", "backend": "fsdp"}, {"type": "zero2", "backend": "deepspeed"},
     {"type": "zero1", "backend": "deepspeed"}],
    ids=["ddp", "zero2", "zero1"],
)  # fmt: skip
def test_a_replicated_rank_reading_s3_counts_its_stripes(strategy: dict[str, str]) -> None:
    s3, hub = plan_job(spec_of(S3, strategy)), plan_job(spec_of(HUB, strategy))
    assert s3.fits and s3.world_size > 1 and s3.strategy == strategy["type"]
    assert s3.architecture is not None
    m = shape_of(s3.architecture)
    largest = largest_module_parameters(m)
    e = 2  # LoRA under bf16: a bf16 base
    assert s3.memory.parameters == hub.memory.parameters
    old = s3.memory.parameters + largest * 4  # the replica plus one module's fp32 init
    assert hub.load_peak_bytes == old  # from a volume or the hub nothing is striped
    stripes = striped_read_bytes(s3.memory.parameters, largest * e, s3.world_size, element_bytes=e)
    group = stripe_group_bytes(s3.memory.parameters, largest * e, s3.world_size)
    reads = ranged_read_bytes(group * 4 // e)
    assert group + reads == stripes  # split between the device and the host, none lost
    # On the device: the stripes, or one module's fp32 init if more (here the 0.5 GB embedding).
    assert s3.load_peak_bytes == s3.memory.parameters + max(group, largest * 4)
    assert s3.load_peak_bytes < s3.memory.peak
    # On the host: the reads in flight, 320 MiB, beside the runtime (not beside a save).
    p = build_problem(spec_of(S3, strategy))
    row = next(r for r in strategies_for(p, s3.world_size) if r.name == s3.strategy)
    ev = evaluate(p, s3.world_size, row, s3.micro_batch_size, s3.activation_checkpointing)
    assert ev.load_host_bytes == reads == READ_BATCH_BYTES + READ_PART_BYTES
    hub_p = build_problem(spec_of(HUB, strategy))
    hub_ev = evaluate(hub_p, s3.world_size, row, s3.micro_batch_size, ev.shape.checkpointing)
    assert hub_ev.load_host_bytes == 0


def test_sharded_rows_read_no_stripes() -> None:
    # FSDP reads each rank's shard straight into it: the same figure from s3 and the hub.
    strategy = {"type": "fsdp-full-shard", "backend": "fsdp"}
    s3, hub = plan_job(spec_of(S3, strategy)), plan_job(spec_of(HUB, strategy))
    assert s3.load_peak_bytes == hub.load_peak_bytes


def test_sharded_reads_from_s3_are_host_memory_beside_the_runtime_not_a_save() -> None:
    """FSDP2 reading its shards from a bucket holds the ranged reads in host RAM on a GPU; a
    phase before the first step, so the host need is the larger of it and a save, not both."""
    strategy = {"type": "fsdp-full-shard", "backend": "fsdp"}
    p = build_problem(spec_of(S3, strategy))
    row = strategies_for(p, 8)[0]
    ev = evaluate(p, 8, row, 1, True)
    assert ev.load_host_bytes == READ_BATCH_BYTES + READ_PART_BYTES
    assert ev.host_need == ev.runtime_host_bytes + max(ev.load_host_bytes, ev.save_host_bytes)
    sync = make_spec(
        model={"name": "meta-llama/Llama-2-7b-hf", **S3},
        method={"type": "lora"},
        strategy=strategy,
        resources={"gpusPerNode": 8, "maxGPUs": 8},
        storage={"objectStore": {"region": "us-east-1"}},
        checkpoint={"enabled": False},
    )
    q = build_problem(sync)
    alone = evaluate(q, 8, row, 1, True)
    assert alone.save_host_bytes == 0
    assert alone.host_need == alone.runtime_host_bytes + alone.load_host_bytes
