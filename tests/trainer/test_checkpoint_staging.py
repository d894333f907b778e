"""The checkpointer's own staging buffers and failed saves, in one process (gloo, world 1):
buffers allocated once and reused, the staged copy is the state at the save (not what the
optimizer makes of it later), FSDP2 DTensors keep their sharding, a failed save is logged with
its traceback and counted, and training goes on."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from finetune_trainer import checkpoint_store as store
from finetune_trainer.errors import UnsupportedRuntimeError
from finetune_trainer.location import locate
from finetune_trainer.parallelize import _no_buffer_sync_in_forward
from finetune_trainer.staging import HostStaging
from finetune_trainer.state import TrainState
from finetune_trainer.torch_floor import check_torch
from tests.trainer.test_checkpointer import checkpointer, new_state, train_steps


def failures(ckpt: object) -> float:
    return float(ckpt.metrics.ckpt_failures._value.get())  # type: ignore[attr-defined]


def test_buffers_are_allocated_once_and_reused(
    tmp_path: Path, ckpt_group: dist.ProcessGroup
) -> None:
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group, keep=10)
    ckpt.prepare()  # a fresh run: sizing now would initialise the optimizer state, so wait
    assert ckpt.staging is not None and ckpt.staging.allocations == 0
    assert not state.optimizer.state
    train_steps(state, 1, ckpt)  # maybe_save prepares after the first step
    assert ckpt.staging.allocations == 1
    train_steps(state, 7, ckpt)  # saves at 2, 4, 6, 8
    assert state.optimizer.state_dict()["state"][0]["step"] == 8  # no extra optimizer step
    assert ckpt.finish(timeout=30)
    assert [
        c.step for c in store.committed_newest_first(locate(str(tmp_path), "checkpoint.uri"))
    ] == [8, 6, 4, 2]
    assert ckpt.staging.allocations == 1  # not one per save
    assert len(ckpt.metrics.stalls) == 4  # one blocking/stall estimate per save
    ckpt.close()


def test_buffers_are_reallocated_when_the_layout_changes() -> None:
    staging = HostStaging(torch.device("cpu"))
    small = {"w": torch.ones(4), "n": 3}
    staging.launch(small).copy_host()
    staging.launch({"w": torch.zeros(4), "n": 4}).copy_host()
    assert staging.allocations == 1
    staged = staging.launch({"w": torch.ones(6), "b": torch.ones(2, dtype=torch.bfloat16)})
    staged.copy_host()
    assert staging.allocations == 2
    assert staged.state_dict["b"].dtype == torch.bfloat16
    assert torch.equal(staged.state_dict["w"], torch.ones(6))


def test_staged_copy_is_the_state_at_the_save(
    tmp_path: Path, ckpt_group: dist.ProcessGroup
) -> None:
    """Training goes on while the save is written; the checkpoint must hold step 2's state."""
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group, keep=10)
    train_steps(state, 2, ckpt)  # save of step 2 launched
    at_save = {k: v.clone() for k, v in state.model.state_dict().items()}
    train_steps(state, 1, ckpt)  # the optimizer changes the live tensors
    assert not all(torch.equal(v, at_save[k]) for k, v in state.model.state_dict().items())
    assert ckpt.finish(timeout=30)
    ckpt.close()

    fresh = new_state()
    with torch.no_grad():
        for p in fresh.model.parameters():
            p.add_(1.0)
    resumed = checkpointer(fresh, tmp_path, ckpt_group)
    assert resumed.load() == 2
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, at_save[k]), k
    resumed.close()


def test_dtensor_shards_are_staged_with_their_spec(
    tmp_path: Path, ckpt_group: dist.ProcessGroup
) -> None:
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    fully_shard(model, mesh=mesh)
    staging = HostStaging(torch.device("cpu"))
    live = model.state_dict()
    staged = staging.launch(live)
    staged.copy_host()
    for k, v in live.items():
        out = staged.state_dict[k]
        assert isinstance(out, DTensor) and out.placements == v.placements, k
        assert out.to_local().data_ptr() != v.to_local().data_ptr()  # a copy, not the live shard
        assert torch.equal(out.full_tensor(), v.full_tensor()), k


def test_failed_save_is_visible_and_training_goes_on(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "step-00000004").write_text("a file where the step directory must go")
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group, keep=10)
    with caplog.at_level(logging.ERROR, logger="finetune_trainer.dcp_checkpointer"):
        train_steps(state, 6, ckpt)
        assert ckpt.finish(timeout=30)
    assert [
        c.step for c in store.committed_newest_first(locate(str(tmp_path), "checkpoint.uri"))
    ] == [6, 2]
    assert ckpt.last_failed_step == 4 and ckpt.last_committed_step == 6
    assert failures(ckpt) == 1
    assert ckpt.metrics.last_failed_ckpt_step._value.get() == 4
    failed = [r for r in caplog.records if "checkpoint step 4: write failed" in r.getMessage()]
    assert failed and failed[0].exc_info is not None  # the traceback, not one line
    assert any("NOT committed" in r.getMessage() for r in caplog.records)
    ckpt.close()


def test_sync_save_failure_is_counted_too(tmp_path: Path, ckpt_group: dist.ProcessGroup) -> None:
    (tmp_path / "step-00000002").write_text("blocked")
    state: TrainState = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group)
    ckpt.mode = ckpt.mode.SYNC
    ckpt.staging = None
    train_steps(state, 4, ckpt)
    assert ckpt.finish(timeout=30)
    assert ckpt.last_failed_step == 2 and ckpt.last_committed_step == 4
    assert failures(ckpt) == 1
    ckpt.close()


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("2.13.0+cpu", True),
        ("2.11.0+cu130", True),
        ("3.0.0", True),
        ("2.10.1", False),
        ("2.6.0", False),
        ("nightly", False),
    ],
    ids=["image", "gpu-box", "next-major", "below", "old", "unreadable"],
)
def test_torch_floor(version: str, ok: bool) -> None:
    if ok:
        check_torch(version)
    else:
        with pytest.raises(UnsupportedRuntimeError, match="torch"):
            check_torch(version)


def test_ddp_arguments_match_the_installed_torch() -> None:
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    assert set(_no_buffer_sync_in_forward()) <= set(params)


def test_a_staging_failure_on_the_training_thread_is_a_failed_save_not_a_crash(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group, keep=10)
    assert ckpt.staging is not None
    real_launch = ckpt.staging.launch

    def launch_once_fails(sd: dict[str, object]) -> object:
        monkeypatch.setattr(ckpt.staging, "launch", real_launch)
        raise RuntimeError("cannot pin host memory")

    monkeypatch.setattr(ckpt.staging, "launch", launch_once_fails)
    train_steps(state, 4, ckpt)
    assert ckpt.finish(timeout=30)
    assert ckpt.last_failed_step == 2 and ckpt.last_committed_step == 4
    assert failures(ckpt) == 1
    assert [
        c.step for c in store.committed_newest_first(locate(str(tmp_path), "checkpoint.uri"))
    ] == [4]
    ckpt.close()
