"""finetune_trainer.replica_loading.gather_rows under two real gloo processes: each rank's
stripe (its torch.chunk rows of dim 0) is gathered whole into the parameter, rows that split
evenly or not (a rank with no rows included), and every tensor the collectives are handed is
a view of the parameter itself: the backend holds a collective's tensors past its wait (gloo's
worker thread drops its work after marking it complete), so a gather buffer outlived the
striped load it belonged to on a busy host (planner.loading.striped_read_bytes)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow  # two spawned processes, each importing torch

WORLD = 2
SHAPES = [(8, 3), (5, 3), (1, 4), (7,)]  # even; uneven; rank 1 without rows; 1-D, uneven


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from finetune_trainer.replica_loading import gather_rows

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)  # fmt: skip
    mesh = init_device_mesh("cpu", (WORLD,))
    handed: list[int] = []  # storage pointers of the tensors the collectives were given

    def recording(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            handed.extend(
                a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)
            )
            return fn(*args, **kwargs)

        return call

    dist.all_gather_into_tensor = recording(dist.all_gather_into_tensor)
    dist.broadcast = recording(dist.broadcast)
    rows = []
    for i, shape in enumerate(SHAPES):
        whole = torch.arange(torch.Size(shape).numel(), dtype=torch.bfloat16).reshape(shape) + i
        chunks = torch.chunk(whole, WORLD)
        local = chunks[rank] if rank < len(chunks) else whole[:0]
        stripe = DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False,
                                    shape=whole.shape, stride=whole.stride())  # fmt: skip
        param = torch.full_like(whole, -1)
        handed.clear()
        gather_rows(param, stripe)
        mine = param.untyped_storage().data_ptr()
        rows.append({"equal": torch.equal(param, whole), "handed": len(handed),
                     "views_of_param": all(p == mine for p in handed)})  # fmt: skip
    # A non-contiguous parameter (a transposed view; not a layout the trainer builds) takes
    # the padded gather buffer instead: still every row, uneven split included.
    whole = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    chunks = torch.chunk(whole, WORLD)
    stripe = DTensor.from_local(chunks[rank].clone(), mesh, [Shard(0)], run_check=False,
                                shape=whole.shape, stride=whole.stride())  # fmt: skip
    param = torch.full((3, 5), -1.0).t()
    assert not param.is_contiguous()
    gather_rows(param, stripe)
    rows.append({"equal": torch.equal(param, whole), "handed": 1, "views_of_param": True})
    (out / f"{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def test_rows_are_gathered_in_place_into_the_parameter(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), tmp_path), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        rows = json.loads((tmp_path / f"{rank}.json").read_text())
        assert rows.pop()["equal"], (rank, "non-contiguous")
        for shape, row in zip(SHAPES, rows, strict=True):
            assert row["equal"], (rank, shape)
            assert row["handed"] >= 1 and row["views_of_param"], (rank, shape, row)
