"""Pretrained safetensors in a local directory (finetune_trainer.safetensors_ranges): the
files are mapped and each slice copied from the page cache, not fetched by fsspec ranges into
buffers; and tensors of every dtype and shape the reader takes load alike from a directory
and from an object store (an in-memory fsspec filesystem stands in for s3fs)."""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import save, save_file
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from finetune_trainer.location import Location, locate
from finetune_trainer.ranged_reads import RetryPolicy, ShortReadError
from finetune_trainer.safetensors_ranges import RangedSafetensorsReader


def mixed() -> dict[str, torch.Tensor]:
    """Every dtype family, a scalar, and empty tensors (no rows, and rows of no bytes)."""
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(33, 8, generator=g).to(torch.bfloat16),
        "half.weight": torch.randn(5, 3, generator=g).to(torch.float16),
        "full.weight": torch.randn(7, 2, 3, generator=g),
        "q.weight": torch.randint(-128, 127, (9, 5), generator=g, dtype=torch.int8),
        "mask": torch.rand(6, generator=g) > 0.5,
        "steps": torch.tensor(41, dtype=torch.int64),
        "no_rows": torch.zeros(0, 4),
        "empty_rows": torch.zeros(3, 0, dtype=torch.float16),
    }


def on_local(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Location:
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return locate(str(tmp_path), "spec.model")


def in_memory(data: bytes) -> Location:
    """A directory on fsspec's memory filesystem holding `data` as its model.safetensors."""
    fs = fsspec.filesystem("memory")
    root = f"/mixed-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(f"{root}/model.safetensors", data)
    return Location(fs, root, {})


def on_memory(tensors: dict[str, torch.Tensor]) -> Location:
    return in_memory(save(tensors))


class Counted:
    """Wraps `fs.cat_ranges`: records every range asked."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.original = fs.cat_ranges
        self.ranges: list[tuple[int, int]] = []

    def __call__(self, paths: list[str], starts: list[int], ends: list[int],
                 **kw: object) -> list[object]:  # fmt: skip
        self.ranges.extend(zip(starts, ends, strict=True))
        return list(self.original(paths, starts, ends, **kw))


def read_into(
    reader: RangedSafetensorsReader, item: ReadItem, target: torch.Tensor
) -> list[torch.Tensor]:
    """Read one `item` into `target` through a planner that resolves every item to it; the
    tensors the reader committed."""
    committed: list[torch.Tensor] = []

    class Planner:
        def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
            return target

        def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
            committed.append(tensor)

    reader.read_data(LoadPlan([item]), Planner()).wait()  # type: ignore[arg-type]
    return committed


@pytest.mark.parametrize("where", ["local", "memory"])
def test_every_dtype_and_shape_loads(where: str, tmp_path: Path) -> None:
    want = mixed()
    location = on_local(tmp_path, want) if where == "local" else on_memory(want)
    assert location.is_local == (where == "local")
    # bf16 on disk into an fp32 master, as full fine-tuning loads it; the rest as stored.
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    state["embed.weight"] = torch.zeros(33, 8)
    # Tiny parts and batches: requests split and reassembled at every boundary.
    reader = RangedSafetensorsReader(location, part_bytes=24, batch_bytes=40)
    dcp.load(state, storage_reader=reader, no_dist=True)
    for name, tensor in want.items():
        got = state[name]
        assert got.shape == tensor.shape, name
        assert torch.equal(got.to(tensor.dtype), tensor), name
    assert state["embed.weight"].dtype == torch.float32


def test_a_local_directory_is_mapped_not_fetched_by_ranges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = mixed()
    location = on_local(tmp_path, want)
    fs = location.fs
    assert isinstance(fs, LocalFileSystem)
    counted = Counted(fs)
    monkeypatch.setattr(fs, "cat_ranges", counted)
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    reader = RangedSafetensorsReader(location)
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert all(torch.equal(state[k], want[k]) for k in want)
    # The header's length and the header only: the data comes from the mapped pages.
    assert len(counted.ranges) == 2 == reader.requests, counted.ranges
    assert reader.bytes_read == reader.bytes_total and reader.bytes_gaps == 0


def test_a_local_file_cut_short_after_its_listing_is_a_short_read(tmp_path: Path) -> None:
    want = {"embed.weight": torch.arange(64.0).view(16, 4), "norm.weight": torch.ones(4)}
    location = on_local(tmp_path, want)
    reader = RangedSafetensorsReader(location, retry=RetryPolicy(attempts=1))
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    metadata = reader.read_metadata()
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-40])  # replaced by a shorter file since listed
    reader.set_up_storage_reader(metadata, True)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, True)
    with pytest.raises(ShortReadError, match=r"model\.safetensors"):
        reader.read_data(planner.create_local_plan(), planner).wait()


def test_a_slice_of_rows_without_bytes_is_read_as_its_shape(tmp_path: Path) -> None:
    # DCP's default planner asks nothing of a zero-size tensor; a planner that does (or a
    # row slice of a (N, 0) tensor) gets the rows asked, not a reshape error.
    want = {"empty_rows": torch.zeros(3, 0, dtype=torch.float16), "w": torch.ones(2, 2)}
    reader = RangedSafetensorsReader(on_memory(want))
    reader.set_up_storage_reader(reader.read_metadata(), True)
    target = torch.full((2, 0), 7.0, dtype=torch.float16)
    zero = torch.Size([0, 0])
    item = ReadItem(
        LoadItemType.TENSOR, MetadataIndex("empty_rows", torch.Size([1, 0])),
        torch.Size([1, 0]), MetadataIndex("empty_rows", zero), torch.Size([1, 0]),
        torch.Size([2, 0]),
    )  # fmt: skip
    committed = read_into(reader, item, target)
    assert [tuple(t.shape) for t in committed] == [(2, 0)]
