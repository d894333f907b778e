"""fp16 on the torch backend: dynamic loss scaling (finetune_trainer.loss_scale) in one process,
and under torchrun (2 ranks, gloo, CPU) with an overflow only one rank sees."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from finetune_operator.api.spec import TrainingSpec
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.faults import FaultConfig, build_faults
from finetune_trainer.loss_scale import DynamicLossScale, NoLossScale, build_loss_scale
from finetune_trainer.optim import build_optimizer, build_scheduler
from finetune_trainer.sampler import StepSampler
from finetune_trainer.state import TrainState
from tests.trainer.conftest import (
    Proc,
    launch_standalone,
    make_job,
    step_lines,
    tail,
    write_job,
)

CPU = torch.device("cpu")


def _backward(model: nn.Module, scale: DynamicLossScale) -> None:
    x = torch.ones(4, 3)
    scale.scale(model(x).pow(2).mean()).backward()


def test_bf16_and_fp32_do_not_scale() -> None:
    for precision in ("bf16", "fp32"):
        assert isinstance(build_loss_scale(precision, CPU), NoLossScale)
    assert isinstance(build_loss_scale("fp16", CPU), DynamicLossScale)
    # DeepSpeed's engine scales fp16 itself: the loop must not scale a second time.
    assert isinstance(build_loss_scale("fp16", CPU, backend="deepspeed"), NoLossScale)


def test_overflow_skips_the_step_halves_the_scale_and_recovers(world_one: None) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = DynamicLossScale(CPU, init_scale=1024.0, growth_interval=2)
    faults = build_faults(FaultConfig(overflow_at_step=2, overflow_rank=0), rank=0)
    applied, scales = [], []
    for step in (1, 2, 3, 4, 5):
        before = [p.detach().clone() for p in model.parameters()]
        _backward(model, scale)
        faults.before_optimizer_step(step, model)
        scale.unscale(opt)
        applied.append(scale.step(opt))
        scales.append(scale.value())
        changed = any(
            not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)
        )
        assert changed == applied[-1], step  # a skipped step leaves the weights alone
        assert all(torch.isfinite(p).all() for p in model.parameters())
        opt.zero_grad()
    assert applied == [True, False, True, True, True]
    # Halved at the overflow, doubled again after growth_interval (2) clean steps.
    assert scales == [1024.0, 512.0, 512.0, 1024.0, 1024.0]
    assert scale.skipped == 1


def test_scale_state_round_trips() -> None:
    a = DynamicLossScale(CPU, init_scale=256.0)
    b = DynamicLossScale(CPU)
    b.load_state_dict(a.state_dict())
    assert b.value() == 256.0
    b.load_state_dict({})  # a checkpoint without a scale (bf16, older) keeps the current one
    assert b.value() == 256.0


def test_checkpoint_carries_the_scale(world_one: None) -> None:
    """A resumed fp16 run goes on at the scale it had, not at 2^16 again (which would cost
    a string of skipped steps to find it)."""

    def state(scale: DynamicLossScale) -> TrainState:
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = build_scheduler(opt, make_job().spec.training, total_steps=10)
        sampler = StepSampler(
            num_samples=8, global_batch=4, micro_batch_size=2, rank=0, world_size=1, seed=1
        )
        return TrainState(model, opt, sched, sampler, rank=0, seed=1, loss_scale=scale)

    saved = state(DynamicLossScale(CPU, init_scale=128.0)).capture()
    resumed = state(DynamicLossScale(CPU))
    resumed.restore(saved)
    assert resumed.loss_scale.value() == 128.0


SKIP = re.compile(r"rank(\d) WARNING .*step (\d+): fp16 gradients overflowed")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp-full-shard"])
def test_fp16_two_ranks_skip_the_same_overflowing_step(
    tmp_path: Path, procs: list[Proc], strategy: str
) -> None:
    """Only rank 1 sees the overflow (inf in its own gradient, after the reduction: under
    FSDP its shard alone); both ranks skip step 5, the scale halves, and training goes on
    to a lower loss."""
    job = make_job(
        strategy=strategy,
        training={"maxSteps": 16, "precision": "fp16"},
        checkpoint={"intervalSteps": 100},
    )
    path = write_job(tmp_path / "job.json", job)
    p = launch_standalone(
        path,
        cwd=tmp_path,
        log=tmp_path / "fp16.log",
        procs=procs,
        FT_GRAD_OVERFLOW_AT_STEP="5",
        FT_GRAD_OVERFLOW_RANK="1",
    )
    assert p.wait(300) == 0, tail(p.log)
    skips = sorted((int(r), int(s)) for r, s in SKIP.findall(p.log.read_text(errors="replace")))
    assert skips == [(0, 5), (1, 5)], tail(p.log)
    lines = step_lines(p.log)
    assert [s["step"] for s in lines] == list(range(1, 17))
    scales = [s["loss_scale"] for s in lines]
    assert scales[4] == scales[3] / 2 and len(set(scales[:4])) == 1, scales
    assert scales[-1] == scales[4], scales  # no further overflow
    losses = [s["loss"] for s in lines]
    assert all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


def _adamw8bit() -> TrainingSpec:
    return make_job(training={"optimizer": "adamw8bit"}).spec.training


def test_adamw8bit_without_bitsandbytes_is_a_clear_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if absent
    with pytest.raises(UnsupportedConfigError, match="adamw8bit needs bitsandbytes"):
        build_optimizer(nn.Linear(3, 2), _adamw8bit())


def test_adamw8bit_refuses_fsdp2_sharded_parameters(world_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(UnsupportedConfigError, match="cannot step FSDP2's sharded parameters"):
        build_optimizer(model, _adamw8bit())
