"""What a checkpoint lacks without being another model's is loaded, not refused
(checkpoint_compat.tolerate), under real DCP in one process (gloo, world 1): an MoE expert no
token was routed to before the save (a tiny Switch Transformers, whose experts are separate
modules) has no optimizer state there; an optimizer setting another torch adds or drops.
Another model (an expert more) is still refused."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

from finetune_trainer.checkpoint_compat import IncompatibleCheckpointError
from finetune_trainer.optim import build_scheduler
from finetune_trainer.sampler import StepSampler
from finetune_trainer.state import TrainState
from tests.trainer.conftest import make_job
from tests.trainer.test_checkpoint_compat import blocks_state
from tests.trainer.test_checkpointer import checkpointer, train_steps

UNROUTED = "expert_3"  # its router bias keeps every token away from it


def moe_state(experts: int = 4) -> TrainState:
    config = SwitchTransformersConfig(
        vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_heads=2,
        num_experts=experts, expert_capacity=64, router_bias=True, router_jitter_noise=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = SwitchTransformersForConditionalGeneration(config)
    route(model, away=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = build_scheduler(opt, make_job().spec.training, total_steps=100)
    sampler = StepSampler(num_samples=50, global_batch=8, micro_batch_size=2, rank=0,
                          world_size=1, seed=1)  # fmt: skip
    return TrainState(model, opt, sched, sampler, rank=0, seed=1)


def route(model: torch.nn.Module, *, away: bool) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.classifier.bias"):
                p[3] = -1e4 if away else 1e4


def moe_steps(state: TrainState, n: int, ckpt: object | None = None) -> None:
    for _ in range(n):
        state.sampler.next_step()
        ids = torch.randint(1, 32, (2, 6))
        state.model(input_ids=ids, labels=ids).loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad()
        state.step += 1
        if ckpt is not None:
            ckpt.maybe_save(state.step)  # type: ignore[attr-defined]


def unrouted(state: TrainState) -> list[torch.nn.Parameter]:
    return [p for n, p in state.model.named_parameters() if UNROUTED in n]


def test_an_expert_no_token_reached_resumes_and_starts_its_state_at_its_first_gradient(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, caplog: pytest.LogCaptureFixture
) -> None:
    state = moe_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group)
    moe_steps(state, 4, ckpt)
    assert ckpt.finish(timeout=60)
    ckpt.close()
    assert len(unrouted(state)) == 4 and not any(
        p in state.optimizer.state for p in unrouted(state)
    )
    saved = {n: {k: v.clone() for k, v in state.optimizer.state[p].items()}
             for n, p in state.model.named_parameters() if p in state.optimizer.state}  # fmt: skip

    fresh = moe_state()
    resumed = checkpointer(fresh, tmp_path, ckpt_group)
    with caplog.at_level(logging.WARNING, logger="finetune_trainer.dcp_resume"):
        assert resumed.load() == 4
    resumed.close()
    warning = next(r.getMessage() for r in caplog.records if "optimizer state" in r.getMessage())
    assert "4 parameter(s) have no optimizer state" in warning and UNROUTED in warning
    # As in the saving run: no state for the expert, the others' exactly as saved.
    assert not any(p in fresh.optimizer.state for p in unrouted(fresh))
    for name, p in fresh.model.named_parameters():
        if name in saved:
            for key, value in saved[name].items():
                torch.testing.assert_close(fresh.optimizer.state[p][key], value, msg=name)
    # Now routed to: its state is created by its first step, the others go on counting.
    route(fresh.model, away=False)
    moe_steps(fresh, 1)
    steps = {n: float(fresh.optimizer.state[p]["step"]) for n, p in fresh.model.named_parameters()}
    assert {s for n, s in steps.items() if UNROUTED in n} == {1.0}
    assert steps["shared.weight"] == 5.0


def test_an_expert_more_is_still_another_model(
    tmp_path: Path, ckpt_group: dist.ProcessGroup
) -> None:
    state = moe_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group)
    moe_steps(state, 2, ckpt)
    assert ckpt.finish(timeout=60)
    ckpt.close()
    resumed = checkpointer(moe_state(experts=5), tmp_path, ckpt_group)
    with pytest.raises(
        IncompatibleCheckpointError, match=r"expert_4.wi.weight \(checkpoint: absent"
    ):
        resumed.load()
    resumed.close()


@pytest.mark.parametrize("side", ["job", "checkpoint"])
def test_an_optimizer_setting_one_torch_has_and_the_other_not_loads(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, caplog: pytest.LogCaptureFixture, side: str
) -> None:
    """A newer torch records a setting in each param group that an older one did not (or the
    other way round, a downgrade): the job keeps its own value of one the checkpoint lacks."""
    state = blocks_state()
    if side == "checkpoint":
        state.optimizer.param_groups[0]["old_setting"] = 0.5
    ckpt = checkpointer(state, tmp_path, ckpt_group)
    train_steps(state, 2, ckpt)
    assert ckpt.finish(timeout=60)
    ckpt.close()
    fresh = blocks_state()
    fresh.optimizer.param_groups[0]["betas"] = (0.8, 0.9)  # the checkpoint's value wins
    if side == "job":
        fresh.optimizer.param_groups[0]["new_setting"] = 0.25
    resumed = checkpointer(fresh, tmp_path, ckpt_group)
    with caplog.at_level(logging.WARNING, logger="finetune_trainer.dcp_resume"):
        assert resumed.load() == 2
    resumed.close()
    group = fresh.optimizer.param_groups[0]
    assert group["betas"] == state.optimizer.param_groups[0]["betas"]
    if side == "job":
        assert group["new_setting"] == 0.25
        assert "keep this job's values: group 0 new_setting" in caplog.text
    else:
        assert "old_setting" not in group
        assert "are not read: group 0 old_setting" in caplog.text
    train_steps(fresh, 1)  # the optimizer steps with what it has
    assert fresh.step == 3


NEWER = "newer_state"  # what a newer torch's AdamW would keep per parameter besides its own


def _add_state(state: TrainState) -> None:
    for p in state.model.parameters():
        state.optimizer.state[p][NEWER] = torch.full_like(p, 0.5)


def test_a_state_a_newer_torchs_optimizer_kept_is_not_read(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, caplog: pytest.LogCaptureFixture
) -> None:
    """Written by an optimizer that keeps one more state per parameter: this one resumes from
    every state it keeps, exactly, and leaves the other unread."""
    state = blocks_state()
    train_steps(state, 1)
    _add_state(state)  # AdamW's step keeps what else is in a parameter's state
    ckpt = checkpointer(state, tmp_path, ckpt_group)
    train_steps(state, 1, ckpt)  # step 2 saved, with the extra state
    assert ckpt.finish(timeout=60)
    ckpt.close()
    fresh = blocks_state()
    resumed = checkpointer(fresh, tmp_path, ckpt_group)
    with caplog.at_level(logging.WARNING, logger="finetune_trainer.dcp_resume"):
        assert resumed.load() == 2
    resumed.close()
    assert f"optimizer does not keep is not read (every state it keeps is): {NEWER}" in caplog.text
    saved = dict(zip(state.model.parameters(), fresh.model.parameters(), strict=True))
    for old_p, new_p in saved.items():
        old, new = state.optimizer.state[old_p], fresh.optimizer.state[new_p]
        assert set(new) == set(old) - {NEWER}
        for name in new:
            assert torch.equal(torch.as_tensor(new[name]), torch.as_tensor(old[name])), name
    train_steps(fresh, 1)  # the optimizer steps with what it keeps
    assert fresh.step == 3


def test_a_state_this_optimizer_keeps_and_the_checkpoint_lacks_is_refused(
    tmp_path: Path, ckpt_group: dist.ProcessGroup
) -> None:
    """The other way round (a checkpoint of an older torch): the state would start at its
    initial value mid-run, changing every update after the resume; refused, naming it."""
    state = blocks_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group)
    train_steps(state, 2, ckpt)
    assert ckpt.finish(timeout=60)
    ckpt.close()
    fresh = blocks_state()
    train_steps(fresh, 1)  # its optimizer state exists, with the state the checkpoint lacks
    _add_state(fresh)
    resumed = checkpointer(fresh, tmp_path, ckpt_group)
    with pytest.raises(IncompatibleCheckpointError, match=rf"\.{NEWER} \(checkpoint: absent"):
        resumed.load()
    resumed.close()
