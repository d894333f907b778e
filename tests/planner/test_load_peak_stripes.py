"""plan.loadPeakBytes counts the stripes a replicated rank (DDP, ZeRO-1/2) holds while it
reads pretrained weights from an object store (finetune_trainer.replica_loading): one DCP
load's stripes, plus the raw reads in flight (the gathers are in place). The figure counted
before (the replica plus one module's fp32 init) left them out."""

from __future__ import annotations

from typing import Any

import pytest
from planner_specs import make_spec

from finetune_operator.api.weights_reads import READ_BATCH_BYTES, READ_PART_BYTES, STRIPE_BYTES
from finetune_operator.planner import plan_job, shape_of
from finetune_operator.planner.loading import largest_module_parameters, striped_read_bytes

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
    assert stripes > largest * 4
    assert s3.load_peak_bytes == s3.memory.parameters + stripes > old
    assert s3.load_peak_bytes < s3.memory.peak


def test_sharded_rows_read_no_stripes() -> None:
    # FSDP reads each rank's shard straight into it: the same figure from s3 and the hub.
    strategy = {"type": "fsdp-full-shard", "backend": "fsdp"}
    s3, hub = plan_job(spec_of(S3, strategy)), plan_job(spec_of(HUB, strategy))
    assert s3.load_peak_bytes == hub.load_peak_bytes
