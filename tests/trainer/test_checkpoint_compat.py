"""A checkpoint written for another model or setup is refused, never taken for damage
(finetune_trainer.checkpoint_compat): the pure comparison of {key: size} maps, the refusal's
message, and the DCP checkpointer in one process (gloo, world 1) resuming onto another
architecture: refused, every checkpoint left as it was; damage still skipped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from finetune_trainer import checkpoint_store as store
from finetune_trainer.checkpoint_compat import (
    Difference,
    IncompatibleCheckpointError,
    Shape,
    compare,
    metadata_shapes,
    refusal_message,
    state_dict_shapes,
)
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.optim import build_scheduler
from finetune_trainer.sampler import StepSampler
from finetune_trainer.state import TrainState
from tests.trainer.conftest import make_job
from tests.trainer.test_checkpointer import L, checkpointer

# What a small LoRA job saves and expects (names as get_state_dict gives them).
Q_A = "model.base_model.model.layers.0.q_proj.lora_A.default.weight"
Q_B = "model.base_model.model.layers.0.q_proj.lora_B.default.weight"
V_A = "model.base_model.model.layers.0.v_proj.lora_A.default.weight"
B_STATE = "optim.state.base_model.model.layers.0.q_proj.lora_B.default.weight"
V_STATE = "optim.state.base_model.model.layers.0.v_proj.lora_A.default.weight"
A_STATE = "optim.state.base_model.model.layers.0.q_proj.lora_A.default.weight"
B_ADAM: dict[str, Shape] = {f"{B_STATE}.exp_avg": (64, 8), f"{B_STATE}.step": ()}
SAVED: dict[str, Shape] = {
    Q_A: (8, 64),
    Q_B: (64, 8),
    "optim.state.base_model.model.layers.0.q_proj.lora_A.default.weight.exp_avg": (8, 64),
    "optim.state.base_model.model.layers.0.q_proj.lora_A.default.weight.step": (),
    "optim.param_groups.0.lr": None,
    "optim.param_groups.0.params": None,
    "train": None,
    "rng.rank0.cpu": (5056,),
}


def changed(**entries: Shape) -> dict[str, Shape]:
    return {**SAVED, **entries}


def without(*keys: str) -> dict[str, Shape]:
    return {k: v for k, v in SAVED.items() if k not in keys}


@pytest.mark.parametrize(
    ("saved", "expected", "differences"),
    [
        pytest.param(SAVED, SAVED, [], id="same"),
        # A larger world wrote more RNG streams; a newer torch records another hyperparameter.
        pytest.param(
            changed(**{"rng.rank1.cpu": (5056,), "optim.param_groups.0.new": None}),
            SAVED,
            [],
            id="other-ranks-rng-and-a-new-hyperparameter",
        ),
        pytest.param(
            SAVED,
            changed(**{Q_A: (4, 64), Q_B: (64, 4)}),
            [Difference(Q_A, (8, 64), (4, 64)), Difference(Q_B, (64, 8), (64, 4))],
            id="lora-rank",
        ),
        pytest.param(
            SAVED,
            changed(**{V_A: (8, 64)}),
            [Difference(V_A, None, (8, 64), in_checkpoint=False)],
            id="a-target-added",
        ),
        # The case DCP loads without an error: the job asks for less than the checkpoint holds.
        pytest.param(
            changed(**{V_A: (8, 64)}),
            SAVED,
            [Difference(V_A, (8, 64), None, in_job=False)],
            id="a-target-removed",
        ),
        pytest.param(
            SAVED,
            changed(train=(1,)),
            [Difference("train", None, (1,))],
            id="tensor-where-bytes-were",
        ),
        pytest.param(SAVED, without("train"), [], id="an-entry-the-job-does-not-read"),
        # lora_B never had a gradient before the save: no optimizer state for it there.
        pytest.param(
            SAVED,
            changed(**{f"{B_STATE}.exp_avg": (64, 8), f"{B_STATE}.step": ()}),
            [],
            id="a-parameter-without-optimizer-state",
        ),
        # The same optimizer keys for a parameter the checkpoint's model lacks: another model.
        pytest.param(
            SAVED,
            changed(**{V_A: (8, 64), f"{V_STATE}.exp_avg": (8, 64)}),
            [
                Difference(V_A, None, (8, 64), in_checkpoint=False),
                Difference(f"{V_STATE}.exp_avg", None, (8, 64), in_checkpoint=False),
            ],
            id="a-new-parameter-is-another-model",
        ),
        pytest.param(
            without(
                "optim.state.base_model.model.layers.0.q_proj.lora_A.default.weight.exp_avg",
                "optim.state.base_model.model.layers.0.q_proj.lora_A.default.weight.step",
            ),
            SAVED,
            [
                Difference(k, None, SAVED[k], in_checkpoint=False)
                for k in SAVED
                if k.startswith("optim.state.")
            ],
            id="no-optimizer-state-at-all-is-no-torch-optimizers",
        ),
        pytest.param(
            SAVED, changed(**{"optim.param_groups.0.new": None}), [], id="a-setting-this-torch-adds"
        ),
        # A newer torch's optimizer keeps a state per parameter that this one does not.
        pytest.param(
            changed(**{f"{A_STATE}.newer": (8, 64)}), SAVED, [], id="a-state-this-torch-lacks"
        ),
        # ... but a state this optimizer keeps and the checkpoint lacks changes the maths.
        pytest.param(
            SAVED,
            changed(**{f"{A_STATE}.newer": (8, 64)}),
            [Difference(f"{A_STATE}.newer", None, (8, 64), in_checkpoint=False)],
            id="a-state-the-checkpoint-lacks",
        ),
        # ... and so does a state this optimizer keeps for another parameter only.
        pytest.param(
            changed(**{f"{A_STATE}.exp_avg_sq": (8, 64), **B_ADAM}),
            changed(**{**B_ADAM, f"{B_STATE}.exp_avg_sq": (64, 8)}),
            [
                Difference(f"{B_STATE}.exp_avg_sq", None, (64, 8), in_checkpoint=False),
                Difference(f"{A_STATE}.exp_avg_sq", (8, 64), None, in_job=False),
            ],
            id="a-state-this-torch-keeps-for-another-parameter",
        ),
        pytest.param(
            SAVED,
            changed(**{"optim.param_groups.1.lr": None}),
            [Difference("optim.param_groups.1.lr", None, None, in_checkpoint=False)],
            id="a-param-group-more",
        ),
    ],
)
def test_compare(
    saved: dict[str, Shape], expected: dict[str, Shape], differences: list[Difference]
) -> None:
    assert compare(saved, expected) == differences


def test_compare_puts_the_model_first_then_the_jobs_order() -> None:
    full = {"model.embed.weight": (32, 8), "model.layers.10.w": (8, 8), "model.layers.2.w": (8, 8),
            "optim.state.embed.weight.exp_avg": (32, 8), "train": None}  # fmt: skip
    keys = [d.key for d in compare(SAVED, full)]
    assert keys[:4] == [
        "model.embed.weight", "model.layers.10.w", "model.layers.2.w", Q_A,
    ]  # fmt: skip
    assert keys.index("optim.state.embed.weight.exp_avg") > keys.index(Q_B)


def test_refusal_names_the_step_keys_both_sizes_and_the_way_out() -> None:
    diffs = compare(SAVED, changed(**{Q_A: (4, 64), Q_B: (64, 4), V_A: (4, 64), "x.y": (1,)}))
    text = refusal_message(6, "s3://b/ckpt", diffs, saved_backend="deepspeed", backend="fsdp")
    assert "checkpoint step 6 in s3://b/ckpt" in text
    assert f"{Q_A} (checkpoint: [8, 64], this job: [4, 64])" in text
    assert f"{V_A} (checkpoint: absent, this job: [4, 64])" in text
    assert "x.y" not in text and "and 1 more" in text  # the first three, the rest counted
    assert "written by the deepspeed backend, this job runs fsdp" in text
    assert "untouched" in text and "checkpoint.uri" in text and "restore the spec" in text
    same = refusal_message(6, "ckpt", diffs, saved_backend="fsdp", backend="fsdp")
    assert "backend" not in same.split("restore the spec")[0]
    assert issubclass(IncompatibleCheckpointError, UnsupportedConfigError)  # TrainerRefused


# ---- the checkpointer, in one process ---------------------------------------------------


class Blocks(nn.Module):
    """Named blocks of one width: dropping one leaves every other key and size as it was."""

    def __init__(self, names: str, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({n: nn.Linear(width, width) for n in names})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


def blocks_state(names: str = "abc", width: int = 8) -> TrainState:
    torch.manual_seed(0)
    model = Blocks(names, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = build_scheduler(opt, make_job().spec.training, total_steps=100)
    sampler = StepSampler(num_samples=50, global_batch=8, micro_batch_size=2, rank=0,
                          world_size=1, seed=1)  # fmt: skip
    return TrainState(model, opt, sched, sampler, rank=0, seed=1)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under the store with its size and modification time."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*")) if p.is_file() and p.name not in ("OWNER", "EPOCH")
    }  # fmt: skip


@pytest.fixture
def saved_abc(tmp_path: Path, ckpt_group: dist.ProcessGroup) -> Iterator[Path]:
    """Steps 2, 4, 6 committed by the blocks a, b, c of width 8."""
    state = blocks_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group, keep=3)
    for _ in range(6):
        state.sampler.next_step()
        state.model(torch.randn(4, 8)).pow(2).mean().backward()
        ckpt.wait_for_staging()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.step += 1
        ckpt.maybe_save(state.step)
    assert ckpt.finish(timeout=30)
    ckpt.close()
    yield tmp_path


def test_what_the_job_expects_is_what_dcp_wrote(
    saved_abc: Path, ckpt_group: dist.ProcessGroup
) -> None:
    """The two sides are computed alike (DCP's flattening, full sizes): an unchanged job
    compares equal, key for key, so a compatible resume is never refused."""
    saved = metadata_shapes(L(saved_abc / "step-00000006").dcp_reader().read_metadata()
                            .state_dict_metadata)  # fmt: skip
    state = blocks_state()
    expected = state.expected_shapes(set(saved))
    assert expected == saved
    assert saved["model.blocks.a.weight"] == (8, 8) and saved["train"] is None
    assert saved["optim.state.blocks.a.weight.step"] == ()
    nested = {"o": {"groups": [{"lr": 0.1, "params": ["a"]}], "betas": (0.9, 0.99)},
              "t": [torch.zeros(2), torch.zeros(3, 1)]}  # fmt: skip
    assert state_dict_shapes(nested) == {
        "o.groups.0.lr": None, "o.groups.0.params": None, "o.betas": None,
        "t.0": (2,), "t.1": (3, 1),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("names", "width", "first"),
    [
        pytest.param(
            "abc",
            16,
            "model.blocks.a.weight (checkpoint: [8, 8], this job: [16, 16])",
            id="hidden-size",
        ),
        pytest.param(
            "abcd",
            8,
            "model.blocks.d.weight (checkpoint: absent, this job: [8, 8])",
            id="a-layer-more",
        ),
        # Loaded silently before: DCP reads only the keys it is asked for.
        pytest.param(
            "ac",
            8,
            "model.blocks.b.weight (checkpoint: [8, 8], this job: absent)",
            id="a-layer-fewer",
        ),
    ],
)
def test_another_architecture_is_refused_and_nothing_is_moved(
    saved_abc: Path, ckpt_group: dist.ProcessGroup, names: str, width: int, first: str
) -> None:
    before = snapshot(saved_abc)
    state = blocks_state(names, width)
    resumed = checkpointer(state, saved_abc, ckpt_group)
    with pytest.raises(IncompatibleCheckpointError) as refused:
        resumed.load()
    resumed.close()
    assert "checkpoint step 6 in" in str(refused.value) and first in str(refused.value)
    assert snapshot(saved_abc) == before
    assert not list(saved_abc.glob("*.corrupt"))
    assert state.step == 0 and resumed.skipped == []
    # The spec that wrote them resumes from the newest, as if nothing had happened.
    again = checkpointer(blocks_state(), saved_abc, ckpt_group)
    assert again.load() == 6
    again.close()


def test_damage_is_still_skipped_before_compatibility_is_judged(
    saved_abc: Path, ckpt_group: dist.ProcessGroup
) -> None:
    """Newest damaged (truncated data): moved aside as before; the next one is undamaged and
    compared, so the job is refused there and step 4 and 2 stay where they are."""
    data = next((saved_abc / "step-00000006").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:64])
    resumed = checkpointer(blocks_state("ac"), saved_abc, ckpt_group)
    with pytest.raises(IncompatibleCheckpointError, match="checkpoint step 4 in"):
        resumed.load()
    resumed.close()
    assert resumed.skipped == [6] and (saved_abc / "step-00000006.corrupt").is_dir()
    assert [c.step for c in store.committed_newest_first(L(saved_abc))] == [4, 2]
