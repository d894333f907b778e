"""finetune_trainer.rank_zero_read under two real gloo processes: rank 0 reads, every rank
gets its result, or its error raised (no rank left waiting in the broadcast)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from finetune_trainer.rank_zero_read import read_on_rank0

pytestmark = pytest.mark.slow  # two spawned processes, each importing torch


def free_port() -> int:
    # Not tests.trainer.conftest's: each spawned process imports this module, kept light.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    calls: list[int] = []

    def read() -> dict[str, int]:
        calls.append(rank)
        return {"read_by": rank}

    def refused() -> None:
        raise ValueError(f"s3://b/m/model.safetensors: a damaged header (rank {rank})")

    got = read_on_rank0(read)
    try:
        read_on_rank0(refused)
        error = None
    except ValueError as e:
        error = str(e)
    (out / f"{rank}.json").write_text(json.dumps({"got": got, "calls": calls, "error": error}))
    dist.destroy_process_group()


def test_rank_zero_reads_for_every_rank_and_its_error_is_every_rank_s(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), tmp_path), nprocs=2, join=True)
    rows = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [r["got"] for r in rows] == [{"read_by": 0}] * 2
    assert [r["calls"] for r in rows] == [[0], []]  # rank 1 never read
    assert [r["error"] for r in rows] == [
        "s3://b/m/model.safetensors: a damaged header (rank 0)"
    ] * 2
