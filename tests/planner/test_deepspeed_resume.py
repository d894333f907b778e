"""The host memory of a DeepSpeed resume (planner/loading.zero_resume_host_bytes): one read
group of the checkpoint's fp32 tensors (finetune_trainer.deepspeed_resume), not every tensor
at once (12 bytes per trainable parameter on every rank, what the trainer held before)."""

from __future__ import annotations

import pytest
from planner_specs import make_spec

from finetune_operator.api.deepspeed_config import RESUME_CHUNK_BYTES
from finetune_operator.api.plan import Plan
from finetune_operator.planner import Candidate, TrainingShape, estimate_memory, plan_job, shape_of
from finetune_operator.planner.architecture import ModelShape
from finetune_operator.planner.catalog import lookup
from finetune_operator.planner.loading import largest_module_parameters, zero_resume_host_bytes
from finetune_operator.planner.lora import adapter_parameters
from finetune_operator.planner.model_states import checkpoint_state_bytes

GIB = 2**30
MODEL = "meta-llama/Llama-3.1-8B"


def llama8b() -> ModelShape:
    return shape_of(lookup(MODEL).architecture)  # type: ignore[union-attr]


@pytest.mark.parametrize("method", ["full", "lora"])
def test_one_read_group_never_the_whole_checkpoint(method: str) -> None:
    m = llama8b()
    shape = TrainingShape(micro_batch_size=1, seq_len=2048, method=method)
    got = zero_resume_host_bytes(m, shape)
    if method == "full":
        # The embedding (128256 x 4096 fp32, 2.1 GB) is read whole: above the 1 GiB cap, it
        # is the budget.
        assert got == 4 * largest_module_parameters(m) > RESUME_CHUNK_BYTES
    else:
        # The adapters' whole checkpoint is below the cap: all of it, no more.
        assert got == 12 * adapter_parameters(m, shape.lora_rank, shape.lora_targets)
    assert 40 * got < 12 * m.total  # the old resume: 12 bytes a parameter (~96 GB) a rank


def test_zero3_offload_8b_fits_a_node_that_the_full_templates_did_not() -> None:
    """Host RAM per process = the offloaded states + the larger of one resume group and the
    async save's staging and write copies (after the first step, the group being freed
    before it); with that (plus 1 GiB) per process the 8-GPU plan fits, where the full
    templates (~96 GB a rank) would have been OOMKilled; 1 GiB less than it, nothing fits
    and the refusal names the resume's group beside the save."""
    m = llama8b()
    shape, cand = TrainingShape(micro_batch_size=1, seq_len=2048), Candidate("zero3", 8, 8, "cpu")
    offloaded = estimate_memory(m, shape, cand).host_bytes
    group = max(zero_resume_host_bytes(m, shape), 2 * checkpoint_state_bytes(m, shape, cand))

    def plan(per_process: int) -> Plan:
        return plan_job(make_spec(
            model={"name": MODEL},
            strategy={"type": "zero3", "backend": "deepspeed", "offload": "cpu"},
            resources={"gpusPerNode": 8, "minNodes": 1, "maxNodes": 1,
                       "memory": f"{8 * per_process // 2**20}Mi"},
        ))  # fmt: skip

    fits = plan(offloaded + group + GIB)
    assert fits.fits and fits.strategy == "zero3" and fits.world_size == 8
    assert offloaded + group + GIB < offloaded + 12 * m.total  # the old need per rank
    refused = plan(offloaded + group - GIB)
    assert not refused.fits
    assert "a resume's read group" in refused.reason, refused.reason
    assert "the checkpoint's staging copy" in refused.reason, refused.reason
