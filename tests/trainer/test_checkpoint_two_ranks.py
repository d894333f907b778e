"""Two ranks (gloo, spawned processes), checkpoints on s3:// (moto's S3 server): a file damaged
in one rank's share of the manifest makes *both* ranks fall back to the previous step, without
a deadlock in DCP's collectives; and what two ranks saved resumes on one (another world size)."""

from __future__ import annotations

import datetime
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from finetune_operator.api.storage import ObjectStoreSpec
from finetune_trainer import checkpoint_store as store
from finetune_trainer.distributed import exit_process
from tests.objectstore import CREDENTIALS, MotoServer
from tests.trainer.conftest import free_port

pytestmark = pytest.mark.slow


def _rank_main(rank: int, uri: str, endpoint: str, port: int, results: str) -> None:
    from tests.trainer.test_checkpointer import checkpointer, new_state, train_steps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **CREDENTIALS)
    object_store = ObjectStoreSpec(endpoint_url=endpoint, region="eu-west-1", path_style=True)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    solo = dist.new_group([0], backend="gloo")  # every rank takes part in making it
    state = new_state()
    ckpt = checkpointer(state, uri, group, keep=3, object_store=object_store)
    ckpt.world_size = 2
    train_steps(state, 6, ckpt)
    assert ckpt.finish(timeout=60)
    ckpt.close()
    dist.barrier()
    root = ckpt.root
    if rank == 0:
        newest = store.step_dir(root, 6)
        marker = store.read_marker(newest)
        manifest = store.manifest_of(marker)
        assert manifest is not None and len(manifest) == 3  # .metadata + one file per rank
        assert marker is not None and marker["worldSize"] == 2
        victim = newest / store.share_of(manifest, 1, 2)[0]  # a file only rank 1 verifies
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: only the hash can tell
        victim.write_atomic(bytes(data))
    dist.barrier()
    # Rank 0's line names the step and the reason, though only rank 1 saw the damage.
    logging.getLogger("finetune_trainer.dcp_resume").addHandler(
        logging.FileHandler(Path(results, f"rank{rank}.log"))
    )
    fresh = new_state()
    resumed = checkpointer(fresh, uri, group, object_store=object_store)
    step = resumed.load()
    Path(results, f"rank{rank}").write_text(f"{step} {resumed.skipped}")
    resumed.close()
    dist.barrier()
    if rank == 0:
        # The same bucket at world size 1: rank 0 alone loads what two ranks saved.
        alone = new_state()
        single = checkpointer(alone, uri, solo, object_store=object_store)
        assert single.load() == 4 and alone.sampler.consumed == 32
        for k, v in alone.model.state_dict().items():
            torch.testing.assert_close(v, fresh.model.state_dict()[k])
        single.close()
        Path(results, "solo").write_text(str(alone.step))
    dist.barrier()
    dist.destroy_process_group()
    exit_process(0)  # not finalisation: see finetune_trainer.distributed.exit_process


def test_damage_seen_by_one_rank_only_falls_back_on_both_then_resumes_at_world_one(
    tmp_path: Path, s3_server: MotoServer
) -> None:
    results = tmp_path / "results"
    results.mkdir()
    uri = f"s3://{s3_server.new_bucket()}/ckpt"
    mp.start_processes(
        _rank_main, args=(uri, s3_server.endpoint, free_port(), str(results)), nprocs=2,
        start_method="spawn", join=True,
    )  # fmt: skip
    assert (results / "rank0").read_text() == "4 [6]"
    assert (results / "rank1").read_text() == "4 [6]"
    assert (results / "solo").read_text() == "4"
    skip = (results / "rank0.log").read_text()
    assert "skipped damaged checkpoint step 6" in skip and "rank 1: " in skip and "hash" in skip
