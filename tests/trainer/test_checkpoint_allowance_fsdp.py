"""Two ranks (gloo, spawned processes) under FSDP2, the trainer's default sharding: a parameter
that never had a gradient before the save (sharded as a DTensor, so no optimizer state on
any rank) resumes from the real DCP checkpoint instead of being refused as another model's,
stays without state, and gets it at its first gradient, as on a first step."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from finetune_operator.api.spec import CheckpointSpec
from finetune_trainer.dcp_checkpointer import DcpCheckpointer
from finetune_trainer.distributed import exit_process
from finetune_trainer.metrics import TrainerMetrics
from finetune_trainer.optim import build_scheduler
from finetune_trainer.sampler import StepSampler
from finetune_trainer.state import TrainState
from tests.trainer.conftest import free_port, make_job

pytestmark = pytest.mark.slow


class WithSpare(nn.Module):
    """Two blocks in use and a spare one the data has not reached yet (an expert no token
    was routed to)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.spare = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.use_spare = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b(self.a(x))
        return self.spare(x) if self.use_spare else x


def _state(rank: int) -> TrainState:
    torch.manual_seed(0)
    model = WithSpare()
    for block in (model.a, model.b, model.spare):
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = build_scheduler(opt, make_job().spec.training, total_steps=100)
    sampler = StepSampler(num_samples=64, global_batch=8, micro_batch_size=2, rank=rank,
                          world_size=2, seed=1)  # fmt: skip
    return TrainState(model, opt, sched, sampler, rank=rank, seed=1)


def _step(state: TrainState) -> None:
    state.sampler.next_step()
    state.model(torch.randn(4, 8)).pow(2).mean().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.step += 1


def checkpointer(state: TrainState, root: str, group: dist.ProcessGroup) -> DcpCheckpointer:
    # Not test_checkpointer's: each spawned rank would import its S3 server's modules too.
    metrics = TrainerMetrics(job="t", rank=dist.get_rank(), device=torch.device("cpu"),
                             reforms=0, total_steps=100)  # fmt: skip
    return DcpCheckpointer(CheckpointSpec(uri=root, interval_steps=2), state,
                           group=group, world_size=2, metrics=metrics, meta={"job": "t"})  # fmt: skip


def _rank_main(rank: int, root: str, port: int, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    state = _state(rank)
    ckpt = checkpointer(state, root, group)
    for _ in range(2):
        _step(state)
        ckpt.maybe_save(state.step)
    assert ckpt.finish(timeout=60)
    ckpt.close()
    spare = [p for n, p in state.model.named_parameters() if "spare" in n]
    assert not any(p in state.optimizer.state for p in spare)

    fresh = _state(rank)
    resumed = checkpointer(fresh, root, group)
    step = resumed.load()
    resumed.close()
    named = dict(fresh.model.named_parameters())
    stateless = sorted(n for n, p in named.items() if p not in fresh.optimizer.state)
    before = dict(state.model.named_parameters())
    same = all(
        torch.equal(fresh.optimizer.state[p]["exp_avg"].to_local(),
                    state.optimizer.state[before[n]]["exp_avg"].to_local())
        for n, p in named.items() if "spare" not in n
    )  # fmt: skip
    fresh.model.use_spare = True  # type: ignore[assignment]
    _step(fresh)
    counts = {n: float(fresh.optimizer.state[p]["step"]) for n, p in named.items()}
    Path(results, f"rank{rank}").write_text(
        f"{step} {','.join(stateless)} {same} {counts['spare.weight']} {counts['a.weight']}"
    )
    dist.barrier()
    dist.destroy_process_group()
    exit_process(0)  # not finalisation: see finetune_trainer.distributed.exit_process


def test_a_parameter_without_gradient_resumes_under_fsdp2_on_two_ranks(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    mp.start_processes(
        _rank_main, args=(str(tmp_path / "ckpt"), free_port(), str(results)), nprocs=2,
        start_method="spawn", join=True,
    )  # fmt: skip
    for rank in (0, 1):
        assert (results / f"rank{rank}").read_text() == "2 spare.bias,spare.weight True 1.0 3.0"
