"""What an s3:// checkpoint write holds on the host, against the plan's figure
(planner/checkpoint_memory.py): DCP's writer (torch 2.13's `_write_item`) torch.saves each
tensor into s3fs's file object in one write, which s3fs buffers whole before it uploads it as a
part (a copy of the buffer): twice the tensor, not one 50 MiB block. s3fs's real S3File, its
S3 calls answered here (no network); the peak read by tracemalloc."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest
import s3fs
import torch
from s3fs.core import S3File

from finetune_operator.planner.checkpoint_memory import save_memory

MIB = 2**20


class LocalS3File(S3File):  # type: ignore[misc]
    """s3fs's file object; the multipart upload's calls answered without a store."""

    def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> dict[str, str]:
        return {"create_multipart_upload": {"UploadId": "u"}, "upload_part": {"ETag": "e"}}.get(
            method, {}
        )

    def commit(self) -> None:
        pass


def written_peak(tensors: list[torch.Tensor]) -> int:
    fs = s3fs.S3FileSystem(anon=True, skip_instance_cache=True)
    f = LocalS3File(fs, "bucket/ckpt/__0_0.distcp", mode="wb")
    tracemalloc.start()
    try:
        for t in tensors:
            torch.save(t, f)  # as FileSystemWriter's _write_item does, item by item
        f.close()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(("mib", "count"), [(16, 10), (160, 2)])
def test_the_plan_holds_what_an_s3_write_buffers(mib: int, count: int) -> None:
    tensors = [torch.zeros(mib * MIB // 4) for _ in range(count)]
    measured = written_peak(tensors)
    state = sum(t.nbytes for t in tensors)
    kw = {"enabled": True, "async_": False, "cuda": False, "deepspeed": False}
    plan = save_memory(
        state, object_store=True, device_snapshot=False, largest_tensor=mib * MIB, **kw
    )
    local = save_memory(state, object_store=False, device_snapshot=False, **kw)
    upload = plan.host_peak - local.host_peak
    assert measured <= upload, (measured / MIB, upload / MIB)
    assert upload < measured + 128 * MIB  # a bound, not a guess far above it
