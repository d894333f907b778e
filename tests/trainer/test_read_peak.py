"""The bytes a ranged safetensors read holds (finetune_trainer.safetensors_ranges,
slice_sink): the raw bytes of one batch of requests and nothing beside them, as the planner
counts (api/weights_reads.READ_BATCH_BYTES, planner.loading.striped_read_bytes). Before, a
request was copied into a buffer of its own while its batch was alive, a request of several
parts assembled whole (up to a tensor), and a slice misaligned for its dtype copied again:
up to twice the planned figure. Python's allocations are traced (`tracemalloc`: the `bytes`
of the GETs, any buffer); the targets are torch's, allocated before and not traced."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.overrides import TorchFunctionMode

from finetune_trainer.location import Location, locate
from finetune_trainer.safetensors_ranges import RangedSafetensorsReader
from finetune_trainer.slice_sink import STAGE_BYTES
from tests.trainer.test_safetensors_local import in_memory, read_into

MiB = 1 << 20
# Python's own bookkeeping during a read (lists, memoryviews, frames): far below a tensor.
SLACK = 256 << 10


def model() -> dict[str, torch.Tensor]:
    """An odd-sized int8 tensor first (see `unsorted`), so every later tensor's bytes are
    misaligned for its dtype; a bf16 tensor, read into fp32 (a conversion); 14 MiB in all."""
    g = torch.Generator().manual_seed(0)
    return {
        "a.q": torch.randint(-128, 127, (9, 5), dtype=torch.int8, generator=g),
        "b.w": torch.randn(1024, 1024, generator=g),
        "c.w": torch.randn(1024, 1024, generator=g).to(torch.bfloat16),
        "d.w": torch.randn(2048, 1024, generator=g),
    }


DTYPES = {torch.int8: "I8", torch.float32: "F32", torch.bfloat16: "BF16"}


def unsorted(tensors: dict[str, torch.Tensor]) -> bytes:
    """A safetensors file with the data in the order given (the format allows any; the
    `safetensors` writer sorts by dtype size, which keeps every tensor aligned)."""
    header: dict[str, object] = {}
    at = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [at, at + size],
        }
        at += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    data = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())
    return struct.pack("<Q", len(raw)) + raw + data


def traced_read(reader: RangedSafetensorsReader, want: dict[str, torch.Tensor]) -> int:
    """Peak bytes Python allocated during the read of every tensor (fp32 for bf16), which
    must come back equal to the files'."""
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    state = {
        k: torch.zeros(v.shape, dtype=torch.float32 if v.dtype == torch.bfloat16 else v.dtype)
        for k, v in want.items()
    }
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, True)
    plan = planner.create_local_plan()
    tracemalloc.start()
    try:
        reader.read_data(plan, planner).wait()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    for name, tensor in want.items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), name
    return peak


def on_memory(tensors: dict[str, torch.Tensor]) -> Location:
    return in_memory(unsorted(tensors))


@pytest.mark.parametrize(
    ("part_bytes", "batch_bytes", "raw_bytes"),
    [
        # One request of one part (the tensors adjacent): the raw batch is the file's data.
        (64 * MiB, 256 * MiB, 14 * MiB),
        # The 8 MiB tensor in 1 MiB parts, 4 MiB of them fetched at a time.
        (1 * MiB, 4 * MiB, 4 * MiB),
    ],
)
def test_a_ranged_read_holds_its_raw_batch_and_nothing_beside(
    part_bytes: int, batch_bytes: int, raw_bytes: int
) -> None:
    want = model()
    reader = RangedSafetensorsReader(
        on_memory(want), part_bytes=part_bytes, batch_bytes=batch_bytes
    )
    peak = traced_read(reader, want)
    # Before: 36 MiB (the request copied beside its batch, each misaligned slice again) and
    # 22 MiB (the 8 MiB tensor assembled beside its parts, then copied again, misaligned).
    assert peak <= raw_bytes + SLACK, (peak, raw_bytes)


def test_a_mapped_read_holds_no_copy_of_a_misaligned_slice(tmp_path: Path) -> None:
    want = model()
    (tmp_path / "model.safetensors").write_bytes(unsorted(want))
    reader = RangedSafetensorsReader(locate(str(tmp_path), "spec.model"))
    # Before: each misaligned slice copied whole (8 MiB at the peak).
    assert traced_read(reader, want) <= SLACK


def test_parts_that_split_elements_load_exactly() -> None:
    # 7-byte parts of misaligned data: elements split between parts (bf16 into fp32: a
    # conversion carried across them; fp32 as stored: bytes straight into the target).
    g = torch.Generator().manual_seed(1)
    want = {
        "a.q": torch.randint(-128, 127, (3, 5), dtype=torch.int8, generator=g),
        "b.w": torch.randn(6, 5, generator=g),
        "c.w": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "d.s": torch.tensor(3.5),
    }
    reader = RangedSafetensorsReader(on_memory(want), part_bytes=7, batch_bytes=29)
    traced_read(reader, want)
    assert reader.requests > 20  # split as asked, not one request


@pytest.mark.parametrize("part_bytes", [7, 1 << 20])
def test_a_slice_of_later_dims_is_assembled_then_taken(part_bytes: int) -> None:
    # No loader here asks for one (FSDP2 shards dim 0; DDP and ZeRO read whole rows); a
    # planner that does gets its columns, from rows assembled once (slice_sink's fallback).
    want = {"a.q": torch.ones(3, dtype=torch.int8), "b.w": torch.arange(30.0).view(6, 5)}
    reader = RangedSafetensorsReader(on_memory(want), part_bytes=part_bytes)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    target = torch.zeros(3, 2)
    at, size = torch.Size([2, 1]), torch.Size([3, 2])
    item = ReadItem(
        LoadItemType.TENSOR, MetadataIndex("b.w", at), at,
        MetadataIndex("b.w", torch.Size([0, 0])), at, size,
    )  # fmt: skip
    committed = read_into(reader, item, target)
    assert len(committed) == 1 and torch.equal(target, want["b.w"][2:5, 1:3])


class _ConvertingCopies(TorchFunctionMode):
    """Records the bytes of each copy_ whose source has another dtype than its target: on a
    GPU, such a copy from the host converts its whole source there first (a temporary of
    that many elements in the target's dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.copy_ and args[0].dtype != args[1].dtype:
            self.sources.append(args[1].numel() * args[1].element_size())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mapped", [False, True])
def test_a_conversion_copies_at_most_stage_bytes_at_a_time(mapped: bool, tmp_path: Path) -> None:
    # 8 MiB of a bf16 tensor into fp32, from one ranged part (aligned for bf16) or from a
    # mapped file where an odd-sized tensor before it misaligns it: before, the aligned
    # piece was converted in one copy (the whole part: a 16 MiB fp32 temporary on the host
    # for a GPU target); now STAGE_BYTES of it per copy, as the misaligned one already was.
    g = torch.Generator().manual_seed(2)
    want = {
        "a.q": torch.ones(3, dtype=torch.int8),
        "c.w": torch.randn(2048, 2048, generator=g).to(torch.bfloat16),
    }
    if mapped:
        (tmp_path / "model.safetensors").write_bytes(unsorted(want))
        reader = RangedSafetensorsReader(locate(str(tmp_path), "spec.model"))
    else:
        reader = RangedSafetensorsReader(on_memory(want), part_bytes=8 * MiB)
    with _ConvertingCopies() as copies:
        traced_read(reader, want)  # the values come back exact
    assert sum(copies.sources) == 8 * MiB
    assert max(copies.sources) <= STAGE_BYTES
