"""Precision and gradient buffers as the planner assumes them (planner/memory.py, trace.py), in
one process (gloo, world 1): FSDP2 bf16 = MixedPrecisionPolicy on every unit over fp32 masters,
no autocast; DDP = gradient buckets as the grads (gradient_as_bucket_view) all-reduced during
backward (overlapped, the wait after the last bucket timed), autocast for bf16; LoRA bf16 = frozen bf16 base + fp32 adapters."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from finetune_operator.api.spec import MethodSpec, Precision
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.model import build_model, decoder_layers
from finetune_trainer.parallelize import Parallel, parallelize
from finetune_trainer.reduction_clock import ReductionClock
from finetune_trainer.tokenizer import build_byte_tokenizer
from finetune_trainer.trainer import precision_context
from tests.trainer.conftest import (
    Proc,
    launch_standalone,
    make_job,
    step_lines,
    tail,
    write_job,
)

CPU = torch.device("cpu")
INPUT = torch.tensor([[256, *b"Mixed precision, as planned.", 257]] * 2)


def model(method: str = "full", precision: Precision = "bf16") -> nn.Module:
    torch.manual_seed(0)
    job = make_job()
    return build_model(
        job.spec.model,
        MethodSpec(type=method),
        build_byte_tokenizer(),
        CPU,
        activation_checkpointing=False,
        precision=precision,
    )


def wrap(m: nn.Module, strategy: str, precision: Precision) -> Parallel:
    job = make_job(strategy=strategy)
    return parallelize(m, job.plan, CPU, 1, precision=precision)


def step(par: Parallel, precision: Precision) -> torch.Tensor:
    """One forward/backward as the loop runs it (`Trainer._forward_backward`)."""
    with par.accumulate(True), precision_context(precision, CPU, autocast=par.autocast):
        out = par.model(input_ids=INPUT, labels=INPUT)
    out.loss.backward()
    return out.logits


def layer_output_dtypes(m: nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    for layer in decoder_layers(m):
        layer.register_forward_hook(
            lambda mod, args, out: seen.append((out[0] if isinstance(out, tuple) else out).dtype)
        )
    return seen


@pytest.mark.parametrize("method", ["full", "lora"])
def test_fsdp_bf16_policy_on_every_unit_and_bf16_activations(world_one: None, method: str) -> None:
    m = model(method)
    seen = layer_output_dtypes(m)
    par = wrap(m, "fsdp-full-shard", "bf16")
    units = [u for u in par.model.modules() if isinstance(u, FSDPModule)]
    assert len(units) == 3  # two decoder layers + the root
    for unit in units:
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            assert group.mp_policy.param_dtype == torch.bfloat16
            assert group.mp_policy.reduce_dtype == torch.float32
    assert not par.autocast and par.zero_grad_set_to_none
    trainable = [p for p in par.model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)  # sharded masters
    logits = step(par, "bf16")
    assert seen == [torch.bfloat16, torch.bfloat16] and logits.dtype == torch.bfloat16
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainable)


def test_fsdp_fp32_casts_nothing(world_one: None) -> None:
    m = model("full", "fp32")
    seen = layer_output_dtypes(m)
    par = wrap(m, "fsdp-full-shard", "fp32")
    unit = next(u for u in par.model.modules() if isinstance(u, FSDPModule))
    assert unit._get_fsdp_state()._fsdp_param_groups[0].mp_policy.param_dtype is None
    assert step(par, "fp32").dtype == torch.float32 and seen == [torch.float32] * 2


def test_ddp_bf16_is_an_fp32_model_under_autocast_with_bucket_view_grads(world_one: None) -> None:
    m = model("full")
    assert all(p.dtype == torch.float32 for p in m.parameters())  # full: fp32 masters
    seen = layer_output_dtypes(m)
    par = wrap(m, "ddp", "bf16")
    ddp = par.model
    assert isinstance(ddp, DistributedDataParallel) and ddp.gradient_as_bucket_view
    assert par.autocast and not par.zero_grad_set_to_none
    # Matmuls in bf16 (logits), the residual stream fp32: what the planner models for DDP.
    assert step(par, "bf16").dtype == torch.bfloat16 and seen == [torch.float32] * 2
    # The grads are views into DDP's buckets: as few storages as buckets, not one per param.
    params = [p for p in ddp.parameters() if p.requires_grad]
    storages = {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
    assert len(storages) <= 3 < len(params)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)


def test_ddp_accumulated_bucket_grads_match_a_plain_model(world_one: None) -> None:
    """Two optimizer steps of 2 micro-batches each: the reduced bucket views, clipping and
    zero_grad(set_to_none=False) train exactly as a plain model does."""
    plain = model("full", "fp32")
    par = wrap(copy.deepcopy(plain), "ddp", "fp32")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, par.model)]
    batches = [INPUT[:1], INPUT[1:]]
    for _ in range(2):
        for i, ids in enumerate(batches):
            (plain(input_ids=ids, labels=ids).loss / 2).backward()
            with par.accumulate(i == 1):
                (par.model(input_ids=ids, labels=ids).loss / 2).backward()
        for m, opt, none in zip((plain, par.model), opts, (True, False), strict=True):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            opt.zero_grad(set_to_none=none)
    ddp_params = dict(par.model.module.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(ddp_params[name], p, rtol=0, atol=1e-6)
    assert all(p.grad is not None and not p.grad.any() for p in ddp_params.values())


@pytest.mark.parametrize(
    ("method", "precision", "base"),
    [
        ("lora", "bf16", torch.bfloat16),
        ("lora", "fp16", torch.float16),
        ("lora", "fp32", torch.float32),
        ("full", "fp16", torch.float32),
        ("full", "bf16", torch.float32),
        ("full", "fp32", torch.float32),
    ],
)
def test_base_and_adapter_dtypes(method: str, precision: Precision, base: torch.dtype) -> None:
    m = model(method, precision)
    frozen = [p for p in m.parameters() if not p.requires_grad]
    trainable = [p for p in m.parameters() if p.requires_grad]
    assert all(p.dtype == base for p in frozen) and (bool(frozen) == (method == "lora"))
    assert trainable and all(p.dtype == torch.float32 for p in trainable)


def test_ddp_bf16_lora_trains_adapters_in_fp32(world_one: None) -> None:
    par = wrap(model("lora"), "ddp", "bf16")
    step(par, "bf16")
    adapters = [p for p in par.model.parameters() if p.requires_grad]
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in adapters)


def test_fsdp_fp16_gathers_fp16_and_reduces_fp32(world_one: None) -> None:
    m = model("full", "fp16")
    seen = layer_output_dtypes(m)
    par = wrap(m, "fsdp-full-shard", "fp16")
    for unit in (u for u in par.model.modules() if isinstance(u, FSDPModule)):
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            assert group.mp_policy.param_dtype == torch.float16
            assert group.mp_policy.reduce_dtype == torch.float32
    assert not par.autocast
    assert step(par, "fp16").dtype == torch.float16 and seen == [torch.float16] * 2
    trainable = [p for p in par.model.parameters() if p.requires_grad]
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainable)


def test_ddp_fp16_is_an_fp32_model_under_fp16_autocast(world_one: None) -> None:
    par = wrap(model("full", "fp16"), "ddp", "fp16")
    assert par.autocast
    assert step(par, "fp16").dtype == torch.float16


def test_unknown_precision_refused_by_parallelize() -> None:
    with pytest.raises(UnsupportedConfigError, match=r"training\.precision fp8"):
        wrap(nn.Linear(2, 2), "ddp", "fp8")  # type: ignore[arg-type]


@pytest.mark.slow
def test_fsdp_bf16_two_ranks_loss_goes_down(tmp_path: Path, procs: list[Proc]) -> None:
    job = write_job(
        tmp_path / "job.json",
        make_job(
            strategy="fsdp-full-shard",
            training={"maxSteps": 40, "precision": "bf16"},
            checkpoint={"intervalSteps": 40},
        ),
    )
    p = launch_standalone(job, cwd=tmp_path, log=tmp_path / "fsdp.log", procs=procs)
    assert p.wait(180) == 0, tail(p.log)
    losses = [s["loss"] for s in step_lines(p.log)]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0, losses


class Params4bit(nn.Parameter):
    """Stands for bitsandbytes' 4-bit weight class (matched by name; no bitsandbytes on CPU)."""


@pytest.mark.parametrize("strategy", ["fsdp-full-shard", "fsdp-shard-grad-op", "zero3"])
def test_qlora_under_fsdp_refused(world_one: None, strategy: str) -> None:
    m = model("full", "fp32")
    m.lm_head.weight = Params4bit(m.lm_head.weight.detach(), requires_grad=False)
    with pytest.raises(
        UnsupportedConfigError,
        match=rf"method.type qlora with strategy.type "
        rf"{strategy}",
    ):
        wrap(m, strategy, "bf16")


def test_ddp_overlaps_the_reduction_and_times_the_wait_after_the_last_bucket(
    world_one: None,
) -> None:
    """The comm hook all-reduces each bucket during backward (overlap) and marks the last one
    handed over; the end of the last micro-batch's backward closes the wait."""
    par = wrap(model("full", "fp32"), "ddp", "fp32")
    clock = getattr(par.reduction_wait, "__self__", None)
    assert isinstance(clock, ReductionClock)
    for i, ids in enumerate([INPUT[:1], INPUT[1:]]):
        with par.accumulate(i == 1):
            par.model(input_ids=ids, labels=ids).loss.backward()
        # no_sync micro-batches hand nothing over; the last one does.
        assert (clock._ready is None) == (i == 0)
    assert 0.0 <= par.reduction_wait() < 5.0


def test_reduction_clock_counts_from_the_last_bucket_to_the_end_of_backward() -> None:
    clock = ReductionClock(CPU)
    assert clock.wait_seconds() == 0.0  # nothing reduced
    clock.start()
    clock.bucket_ready()
    time.sleep(0.2)  # an earlier bucket: not the one that counts
    clock.bucket_ready()
    time.sleep(0.05)
    clock.backward_done()
    assert 0.04 <= clock.wait_seconds() < 0.2
    clock.start()
    assert clock.wait_seconds() == 0.0
