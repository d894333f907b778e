"""Two ranks (gloo, spawned processes): a file damaged in one rank's share of the manifest
makes *both* ranks fall back to the previous step, without a deadlock in DCP's collectives."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from finetune_trainer import checkpoint_store as store
from tests.trainer.conftest import free_port

pytestmark = pytest.mark.slow


def _rank_main(rank: int, root: str, port: int, results: str) -> None:
    from tests.trainer.test_checkpointer import (
        L,
        _flip_in_place,
        checkpointer,
        new_state,
        train_steps,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    path = Path(root)
    state = new_state()
    ckpt = checkpointer(state, path, group, keep=3)
    ckpt.world_size = 2
    train_steps(state, 6, ckpt)
    assert ckpt.finish(timeout=60)
    ckpt.close()
    dist.barrier()
    if rank == 0:
        newest = path / "step-00000006"
        manifest = store.manifest_of(store.read_marker(L(newest)))
        assert manifest is not None and len(manifest) == 3  # .metadata + one file per rank
        victim = store.share_of(manifest, 1, 2)[0]  # a file only rank 1 verifies
        _flip_in_place(newest / victim)
    dist.barrier()
    fresh = new_state()
    resumed = checkpointer(fresh, path, group)
    step = resumed.load()
    Path(results, f"rank{rank}").write_text(f"{step} {resumed.skipped}")
    resumed.close()
    dist.destroy_process_group()


def test_damage_seen_by_one_rank_only_falls_back_on_both(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    mp.start_processes(
        _rank_main, args=(str(tmp_path / "ckpt"), free_port(), str(results)), nprocs=2,
        start_method="spawn", join=True,
    )  # fmt: skip
    assert (results / "rank0").read_text() == "4 [6]"
    assert (results / "rank1").read_text() == "4 [6]"
