"""Two ranks (gloo, spawned processes), a checkpoint on a local directory: a failure that only
one rank meets during the resume is every rank's, and none is left waiting in a collective its
peer never enters (the group's timeout is short: a hang fails the test, not the suite).

- rank 0 cannot list the checkpoint root: both ranks raise (rank 1 an OSError naming rank 0)
  instead of rank 1 waiting for a list that never comes;
- rank 1 alone fails to read its part in DCP's load (an I/O error, no check finding damage),
  with no older step: both raise PartlyLoadedError (neither starts fresh on a state part
  checkpoint, part initial) and the step stays committed, in place."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.trainer.conftest import free_port

pytestmark = pytest.mark.slow  # two spawned processes, each importing torch


def _outcome(action: Any) -> str:
    try:
        return f"ok {action()}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _rank_main(rank: int, root: str, port: int, results: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from finetune_trainer import checkpoint_store as store
    from tests.trainer.test_checkpointer import checkpointer, new_state, train_steps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=20)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
    group = dist.new_group(backend="gloo", timeout=timeout)
    state = new_state()
    ckpt = checkpointer(state, root, group)
    train_steps(state, 2, ckpt)  # one committed step: 2, nothing older
    assert ckpt.finish(timeout=60)
    ckpt.close()
    dist.barrier()
    lines = []

    real_list = store.committed_newest_first

    def list_fails_on_rank0(root: Any) -> Any:
        if rank == 0:
            raise OSError("listing refused")
        return real_list(root)

    store.committed_newest_first = list_fails_on_rank0
    lines.append(_outcome(checkpointer(new_state(), root, group).load))
    store.committed_newest_first = real_list
    dist.barrier()

    real_read = FileSystemReader.read_data

    def read_fails_on_rank1(self: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
        if rank == 1:
            raise OSError("connection reset")
        return real_read(self, *args, **kwargs)

    FileSystemReader.read_data = read_fails_on_rank1  # type: ignore[method-assign]
    lines.append(_outcome(checkpointer(new_state(), root, group).load))
    FileSystemReader.read_data = real_read  # type: ignore[method-assign]
    dist.barrier()
    Path(results, f"rank{rank}").write_text("\n".join(lines))
    dist.destroy_process_group()


def test_a_failure_one_rank_meets_ends_every_ranks_resume(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    root = tmp_path / "ckpt"
    mp.start_processes(
        _rank_main, args=(str(root), free_port(), str(results)), nprocs=2,
        start_method="spawn", join=True,
    )  # fmt: skip
    for rank in range(2):
        listing, partial = (results / f"rank{rank}").read_text().splitlines()
        assert listing.startswith("OSError: "), (rank, listing)
        assert "listing refused" in listing
        assert partial.startswith("PartlyLoadedError: checkpoint step 2 "), (rank, partial)
    assert "rank 0 could not list" in (results / "rank1").read_text()
    assert (root / "step-00000002" / "COMMITTED").is_file()  # left in place, tried again
