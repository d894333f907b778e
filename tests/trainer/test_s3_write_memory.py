"""What an s3:// checkpoint write holds on the host, against the plan's figure
(planner/checkpoint_memory.py): DCP's writer (torch 2.13's `_write_item`) torch.saves each
tensor into s3fs's file object in one write; s3fs buffers it whole, reads the part it uploads
out of that buffer, and the HTTP client copies the part again while it sends it: about three
times the tensor, not one 50 MiB block. The trainer's own writer (Location.dcp_writer) onto
moto's S3 server over HTTP; the peak of Python's allocations while it writes, read by tracemalloc (the state's
tensors themselves are torch storage, not counted: the write's buffers are)."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from finetune_operator.planner.checkpoint_memory import save_memory
from finetune_trainer.location import locate
from tests.objectstore import MotoServer

MIB = 2**20


def _writer(server: MotoServer, uri: str) -> object:
    return locate(uri, "checkpoint.uri", object_store=server.spec()).dcp_writer()


def written_peak(server: MotoServer, group: dist.ProcessGroup, sd: dict[str, torch.Tensor]) -> int:
    root = f"s3://{server.new_bucket()}/ckpt"
    # The client's one-time set-up (botocore's service model, ~10 MiB) before measuring.
    dcp.save({"warm": torch.zeros(4)}, storage_writer=_writer(server, f"{root}/warm"))
    writer = _writer(server, f"{root}/step-00000001")
    tracemalloc.start()
    try:
        dcp.save(sd, storage_writer=writer, process_group=group)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(("mib", "count"), [(16, 10), (160, 2)])
def test_the_plan_holds_what_an_s3_write_buffers(
    mib: int, count: int, ckpt_group: dist.ProcessGroup, s3_credentials: MotoServer
) -> None:
    sd = {f"t{i}": torch.zeros(mib * MIB // 4) for i in range(count)}
    measured = written_peak(s3_credentials, ckpt_group, sd)
    state = sum(t.nbytes for t in sd.values())
    kw = {"enabled": True, "async_": False, "cuda": False, "deepspeed": False}
    plan = save_memory(
        state, object_store=True, device_snapshot=False, largest_tensor=mib * MIB, **kw
    )
    local = save_memory(state, object_store=False, device_snapshot=False, **kw)
    upload = plan.host_peak - local.host_peak
    assert measured <= upload, (measured / MIB, upload / MIB)
    assert upload < measured + 160 * MIB  # a bound, not a guess far above it
