"""The chunked layout's shape record from the save to the refusal, in one process (gloo, world
1): the DCP checkpointer writes the state's `marker_record` into COMMITTED, and the resume
hands the marker to the state's `comparable` before comparing. The state here saves a torch
MLP in DeepSpeed's chunked layout (deepspeed_layout) with DeepSpeedTrainState's two hooks
(an engine takes minutes to build: its own save and resume run in test_deepspeed.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from finetune_trainer.checkpoint_compat import IncompatibleCheckpointError, Shape
from finetune_trainer.deepspeed_layout import (
    CHUNKED,
    SHAPES_KEY,
    ChunkedLayout,
    comparable_shapes,
)
from finetune_trainer.optim import build_scheduler
from finetune_trainer.sampler import StepSampler
from finetune_trainer.state import TrainState
from tests.trainer.conftest import make_job
from tests.trainer.test_checkpointer import checkpointer


class ChunkedMLP(TrainState):
    """An MLP's weights saved flattened, each as its chunk of the world (no optimizer state)."""

    def _shapes(self) -> dict[str, list[int]]:
        return {n: list(p.shape) for n, p in self.model.named_parameters()}

    def capture_model_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        layout = ChunkedLayout()
        model = {n: layout.wrap(p.detach().reshape(-1).clone(), p.numel())
                 for n, p in self.model.named_parameters()}  # fmt: skip
        return {CHUNKED: model}, {}

    def template_model_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        layout = ChunkedLayout()
        model = {n: layout.template(p.numel()) for n, p in self.model.named_parameters()}
        return {CHUNKED: model}, {}

    def restore_model_optim(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(model_sd[CHUNKED][n].to_local().view_as(p))

    def marker_record(self) -> dict[str, Any]:
        return {SHAPES_KEY: self._shapes()}

    def comparable(
        self, saved: dict[str, Shape], expected: dict[str, Shape], marker: dict[str, Any]
    ) -> tuple[dict[str, Shape], dict[str, Shape]]:
        return comparable_shapes(saved, expected, marker.get(SHAPES_KEY), self._shapes())


def mlp_state(hidden: int, intermediate: int) -> ChunkedMLP:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(hidden, intermediate, bias=False),
                          nn.Linear(intermediate, hidden, bias=False))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = build_scheduler(opt, make_job().spec.training, total_steps=100)
    sampler = StepSampler(num_samples=50, global_batch=8, micro_batch_size=2, rank=0,
                          world_size=1, seed=1)  # fmt: skip
    return ChunkedMLP(model, opt, sched, sampler, rank=0, seed=1)


def test_the_recorded_shapes_refuse_a_transposed_mlp(
    tmp_path: Path, ckpt_group: dist.ProcessGroup
) -> None:
    saved = mlp_state(4, 8)
    ckpt = checkpointer(saved, tmp_path, ckpt_group)
    saved.step = 2
    ckpt.maybe_save(2, force=True)
    assert ckpt.finish(timeout=30)
    ckpt.close()
    marker = json.loads((tmp_path / "step-00000002" / "COMMITTED").read_text())
    assert marker[SHAPES_KEY] == {"0.weight": [8, 4], "1.weight": [4, 8]}

    # hidden 8 / intermediate 4: the same names and counts, the matrices transposed.
    other = checkpointer(mlp_state(8, 4), tmp_path, ckpt_group)
    with pytest.raises(IncompatibleCheckpointError) as refused:
        other.load()
    other.close()
    assert "model.chunked.0.weight (checkpoint: [8, 4], this job: [4, 8])" in str(refused.value)

    # Without the record (a chunked checkpoint written before it): counts only, so it loads.
    del marker[SHAPES_KEY]
    (tmp_path / "step-00000002" / "COMMITTED").write_text(json.dumps(marker))
    again = mlp_state(8, 4)
    older = checkpointer(again, tmp_path, ckpt_group)
    assert older.load() == 2
    older.close()
    # The same model resumes, its weights as saved.
    same = mlp_state(4, 8)
    with torch.no_grad():
        same.model[0].weight.zero_()
    resumed = checkpointer(same, tmp_path, ckpt_group)
    assert resumed.load() == 2
    resumed.close()
    assert torch.equal(same.model[0].weight, saved.model[0].weight)
