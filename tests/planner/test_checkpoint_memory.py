"""The checkpoint save's memory in the plan (planner/checkpoint_memory.py): the async staging
buffer and the writer's copy on the host of a GPU job, the device snapshot on the GPU."""

from __future__ import annotations

from dataclasses import replace

from planner_specs import make_spec

from finetune_operator.api.model_spec import ModelArchitecture
from finetune_operator.planner import plan_job
from finetune_operator.planner.architecture import shape_of
from finetune_operator.planner.catalog import lookup
from finetune_operator.planner.checkpoint_memory import (
    S3_WRITE_BLOCK_BYTES,
    SaveMemory,
    save_memory,
)
from finetune_operator.planner.configuration import Candidate, TrainingShape
from finetune_operator.planner.model_states import (
    checkpoint_largest_tensor_bytes,
    checkpoint_state_bytes,
)
from finetune_operator.planner.planning import build_problem
from finetune_operator.planner.search import evaluate, strategies_for

GIB = 2**30
FSDP = {"type": "fsdp-full-shard"}


def _evaluated(**checkpoint: object):  # type: ignore[no-untyped-def]
    p = build_problem(make_spec(strategy=FSDP, checkpoint=checkpoint))
    return p, evaluate(p, 8, strategies_for(p, 8)[0], 1, True)


def test_async_saves_need_the_staged_state_more_host_memory_than_sync_saves() -> None:
    _, sync = _evaluated(**{"async": False})
    _, async_ = _evaluated()
    m = shape_of(lookup("meta-llama/Llama-2-7b-hf").architecture)  # type: ignore[union-attr]
    staged = checkpoint_state_bytes(m, async_.shape, async_.cand)
    # 7B full, bf16 with fp32 masters, 8-way shard: 12 B a parameter over 8 ranks, ~9.4 GiB.
    assert abs(staged - 12 * m.total / 8) < 1e-3 * staged
    assert async_.host_need - sync.host_need == staged
    assert async_.device_need == sync.device_need  # none of it is GPU memory


def test_a_memory_request_that_fits_only_without_staging_is_refused_naming_it() -> None:
    _, sync = _evaluated(**{"async": False})
    per_pod = f"{8 * (sync.host_need + GIB) // 2**20}Mi"

    def plan(**checkpoint: object):  # type: ignore[no-untyped-def]
        resources = {"memory": per_pod, "minNodes": 1, "maxNodes": 1}
        return plan_job(make_spec(strategy=FSDP, resources=resources, checkpoint=checkpoint))

    assert plan(**{"async": False}).fits
    refused = plan()
    assert not refused.fits
    assert "the checkpoint's staging copy (9.4 GiB)" in refused.reason, refused.reason
    assert "checkpoint.async: false (no staging copy) would fit on 8 ranks" in refused.reason, (
        refused.reason
    )


def test_the_device_snapshot_is_counted_in_gpu_memory_and_refused_naming_it() -> None:
    _, off = _evaluated()
    _, on = _evaluated(deviceSnapshot=True)
    assert on.device_need - off.device_need == on.save.staging > 0
    assert on.host_need == off.host_need
    # A GPU that holds the plan without the snapshot (with 10% headroom), not with it.
    gib = -(-off.device_need * 10 // (9 * GIB)) + 1
    assert gib * GIB * 0.9 < on.device_need

    def plan(**checkpoint: object):  # type: ignore[no-untyped-def]
        resources = {"gpu": {"memoryGiB": gib}, "minNodes": 1, "maxNodes": 1}
        return plan_job(make_spec(strategy=FSDP, resources=resources, checkpoint=checkpoint))

    assert plan().fits
    refused = plan(deviceSnapshot=True)
    assert not refused.fits
    assert "the checkpoint's device snapshot (9.4 GiB" in refused.reason, refused.reason
    assert "checkpoint.deviceSnapshot: false would fit on 8 ranks" in refused.reason
    assert "checkpoint.async" not in refused.reason, refused.reason


def test_sync_saves_on_a_cpu_device_copy_nothing_and_deepspeed_always_copies() -> None:
    m = shape_of(lookup("meta-llama/Llama-2-7b-hf").architecture)  # type: ignore[union-attr]
    shape = TrainingShape(micro_batch_size=1, seq_len=512)
    ddp = checkpoint_state_bytes(m, shape, Candidate("ddp", 2, 2, cuda=False))
    ds = checkpoint_state_bytes(m, shape, Candidate("zero2", 2, 2, cuda=False))
    assert ddp == m.total * 12  # Llama-2's head is untied: no duplicate
    assert ds == -(-m.total // 2) * 12  # the rank's chunk of fp32 master + two moments
    lora = TrainingShape(micro_batch_size=1, seq_len=512, method="lora")
    assert checkpoint_state_bytes(m, lora, Candidate("ddp", 2, 2)) < ddp / 100


def test_a_tied_embedding_is_staged_under_both_names() -> None:
    """get_state_dict keeps the tied weight's two keys and HostStaging copies each: the H100
    measurement's 15.88 GB for Llama-3.2-1B at world 1 (bench/results/gpu_checkpoint.md)."""
    arch = ModelArchitecture(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
    )  # Llama-3.2-1B's config.json
    m = shape_of(arch)
    assert m.lm_head == 0
    staged = checkpoint_state_bytes(m, TrainingShape(1, 2048), Candidate("ddp", 1, 1))
    assert abs(staged / 1e9 - 15.88) < 0.02, staged


def test_what_a_save_holds_by_mode() -> None:
    s, kw = 8 * GIB, {"enabled": True, "object_store": False, "device_snapshot": False}
    ddp = save_memory(s, async_=True, cuda=True, deepspeed=False, replicas=8, **kw)
    assert (ddp.staging, ddp.writing) == (s, s // 8)  # DCP spreads the replicas' writes
    sync_gpu = save_memory(s, async_=False, cuda=True, deepspeed=False, **kw)
    assert (sync_gpu.staging, sync_gpu.writing, sync_gpu.during_step) == (0, s, False)
    offloaded = save_memory(s, async_=False, cuda=True, deepspeed=False, on_host=s, **kw)
    assert offloaded.host_peak == 0  # written from host memory as it is
    assert save_memory(s, async_=False, cuda=False, deepspeed=False, **kw).host_peak == 0
    assert save_memory(s, async_=False, cuda=False, deepspeed=True, **kw).host_peak == s
    s3 = save_memory(
        s, async_=False, cuda=False, deepspeed=True, largest_tensor=GIB,
        **{**kw, "object_store": True},
    )  # fmt: skip
    # s3fs buffers the largest tensor whole, copies the part out of it, the HTTP client the
    # part again (checkpoint_memory).
    assert s3.host_peak == s + 3 * (GIB + S3_WRITE_BLOCK_BYTES)
    off = save_memory(s, async_=True, cuda=True, deepspeed=False, **{**kw, "enabled": False})
    assert off == SaveMemory()


def test_the_refusal_tells_activation_checkpointing_from_checkpoint_saves() -> None:
    """The configuration's activation checkpointing is named as such beside the checkpoint
    save's copies: "no checkpointing" next to "the checkpoint's staging copy" read as if
    checkpoints were off."""
    resources = {"memory": "64Gi", "minNodes": 1, "maxNodes": 1}
    refused = plan_job(make_spec(strategy=FSDP, resources=resources))
    assert not refused.fits and "the checkpoint's staging copy" in refused.reason
    assert " checkpointing" not in refused.reason.replace("activation checkpointing", "")
    assert "no activation checkpointing" in refused.reason, refused.reason


def test_the_largest_tensor_a_rank_writes_by_strategy() -> None:
    """What an s3:// root's writer buffers whole (tests/trainer/test_s3_write_memory.py):
    Llama-2-7B's embedding (32000 x 4096) in fp32 masters, as each strategy holds it."""
    m = shape_of(lookup("meta-llama/Llama-2-7b-hf").architecture)  # type: ignore[union-attr]
    shape = TrainingShape(micro_batch_size=1, seq_len=512, precision="bf16")
    embedding = 32000 * 4096 * 4
    assert checkpoint_largest_tensor_bytes(m, shape, Candidate("ddp", 8, 8)) == embedding
    fsdp = checkpoint_largest_tensor_bytes(m, shape, Candidate("fsdp-full-shard", 8, 8))
    assert fsdp == embedding // 8
    assert checkpoint_largest_tensor_bytes(m, shape, Candidate("zero3", 8, 8)) == embedding // 8
    lora = TrainingShape(micro_batch_size=1, seq_len=512, method="lora")  # q, k, v, o
    adapter = checkpoint_largest_tensor_bytes(m, lora, Candidate("ddp", 8, 8))
    assert adapter == lora.lora_rank * 4096 * 4  # one projection's A or B, fp32
    mlp = replace(lora, lora_targets=("q_proj", "down_proj"))
    assert checkpoint_largest_tensor_bytes(m, mlp, Candidate("ddp", 8, 8)) == 16 * 11008 * 4


def test_a_refusal_for_the_staging_copy_says_what_sync_saves_would_need() -> None:
    resources = {"memory": "64Gi", "minNodes": 1, "maxNodes": 1}
    refused = plan_job(make_spec(strategy=FSDP, resources=resources))
    assert not refused.fits
    # 8 GiB a process: at 8 ranks a sync save's copy (9.4 GiB) does not fit either, at 16 the
    # halved shard does; async saves need 24 GPUs.
    hint = "checkpoint.async: false (no staging copy) would fit on 16 ranks"
    assert hint in refused.reason, refused.reason
    assert "Needs >= 24 GPUs" in refused.reason
    sync = plan_job(make_spec(strategy=FSDP, resources=resources, checkpoint={"async": False}))
    assert not sync.fits and "checkpoint.async: false" not in sync.reason
