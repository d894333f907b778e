"""Sharded Hugging Face checkpoints (finetune_trainer.safetensors_index): the index's weight_map
decides which file each tensor is read from, stale files beside the shards are ignored, and
an index that does not match the files is refused naming it; and coalesced ranges
(ranged_reads.coalesce): adjacent small reads go out as one request, counted where fsspec
is asked for them."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save, save_file
from torch.distributed.checkpoint.api import CheckpointException

from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.location import Location, locate
from finetune_trainer.pretrained import load_safetensors
from finetune_trainer.ranged_reads import Request, coalesce, dropped_bytes
from finetune_trainer.safetensors_index import (
    INDEX_NAME,
    absent,
    files_to_read,
    ignored_files,
    owned,
    parse_index,
)
from finetune_trainer.safetensors_ranges import RangedSafetensorsReader

# ---- pure parts ---------------------------------------------------------------------------


def index_bytes(weight_map: dict[str, str]) -> bytes:
    return json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}).encode()


@pytest.mark.parametrize(
    ("raw", "message"),
    [(b"{not json", "not JSON"), (b"{}", "no weight_map"), (b'{"weight_map": []}', "no weight_map"),
     (index_bytes({"w": "../other/model.safetensors"}), r"weight_map\['w'\]"),
     (index_bytes({"w": "model.bin"}), "not a \\*.safetensors file")],
    ids=["not-json", "no-map", "map-not-object", "other-directory", "not-safetensors"],
)  # fmt: skip
def test_a_bad_index_is_refused_naming_it(raw: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        parse_index("s3://b/m/model.safetensors.index.json", raw)
    assert "s3://b/m/model.safetensors.index.json" in str(err.value)


def test_the_index_chooses_the_files_and_each_tensors_file() -> None:
    weight_map = {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "m-2.safetensors"}
    listed = ["m-1.safetensors", "m-2.safetensors", "model.safetensors", "old-3.safetensors",
              "config.json", INDEX_NAME]  # fmt: skip
    assert files_to_read(listed, weight_map) == ["m-1.safetensors", "m-2.safetensors"]
    assert ignored_files(listed, weight_map) == ["model.safetensors", "old-3.safetensors"]
    # Without an index: every safetensors file, none ignored.
    assert files_to_read(listed, None) == sorted(n for n in listed if n.endswith(".safetensors"))
    assert ignored_files(listed, None) == []
    # A stale copy of `c` in m-1 is not read from m-1.
    assert owned("m-1.safetensors", ["a", "c"], weight_map) == ["a"]
    assert owned("m-1.safetensors", ["a", "c"], None) == ["a", "c"]
    assert absent({"a": "m-1.safetensors", "b": "m-2.safetensors"}, weight_map) == [
        ("c", "m-2.safetensors")
    ]


def test_an_index_naming_a_missing_file_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"names \['m-2.safetensors'\], not there") as err:
        files_to_read(["m-1.safetensors"], {"a": "m-1.safetensors", "b": "m-2.safetensors"},
                      "s3://b/m/" + INDEX_NAME)  # fmt: skip
    assert "s3://b/m/" + INDEX_NAME in str(err.value)


def test_the_gaps_between_coalesced_ranges_are_counted_once() -> None:
    ranges = [("f", 0, 100), ("f", 50, 120), ("f", 130, 200), ("g", 0, 10)]
    requests = coalesce(ranges, 20, 300)
    assert dropped_bytes(requests, ranges) == 10  # 120..130; the overlap is no gap
    assert dropped_bytes(coalesce(ranges, -1, 300), ranges) == 0


@pytest.mark.parametrize(
    ("ranges", "want"),
    [
        # Touching and 10 bytes apart: one request; 200 apart: another.
        ([("f", 0, 100), ("f", 100, 150), ("f", 160, 200), ("f", 400, 500)],
         [Request("f", 0, 200, (0, 1, 2)), Request("f", 400, 500, (3,))]),
        # Another file never merges; given out of order, sorted by file and offset.
        ([("g", 0, 10), ("f", 10, 20), ("f", 0, 10)],
         [Request("f", 0, 20, (2, 1)), Request("g", 0, 10, (0,))]),
        # Within the gap but past the request limit (300): a new request.
        ([("f", 0, 200), ("f", 210, 400)], [Request("f", 0, 200, (0,)), Request("f", 210, 400, (1,))]),
        # Larger than the limit alone: its own request (split into parts later).
        ([("f", 0, 1000), ("f", 1000, 1010)],
         [Request("f", 0, 1000, (0,)), Request("f", 1000, 1010, (1,))]),
        # Overlapping (two column slices of the same rows): one request over both.
        ([("f", 0, 100), ("f", 50, 120), ("f", 0, 100)], [Request("f", 0, 120, (0, 2, 1))]),
        ([], []),
    ],
    ids=["adjacent-and-near", "per-file", "limit", "oversized", "overlap", "empty"],
)  # fmt: skip
def test_ranges_of_a_file_within_the_gap_coalesce_up_to_the_limit(
    ranges: list[tuple[str, int, int]], want: list[Request]
) -> None:
    assert coalesce(ranges, 20, 300) == want


# ---- the reader over a directory ----------------------------------------------------------


def write_index(path: Path, weight_map: dict[str, str]) -> None:
    (path / INDEX_NAME).write_bytes(index_bytes(weight_map))


def read(path: Path, state: dict[str, torch.Tensor]) -> None:
    """Load `state` from `path`; the reader's own error raised as it is (DCP flattens it)."""
    reader = RangedSafetensorsReader(locate(str(path), "test"))
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except CheckpointException:
        assert reader.failure is not None
        raise reader.failure from None


def sharded(path: Path) -> dict[str, torch.Tensor]:
    """Two shards and their index, plus what a prefix gathers over time: a consolidated
    copy and an earlier save's shard, both with other values for the same tensors."""
    want = {"a": torch.arange(12.0).view(3, 4), "b": torch.ones(5), "c": torch.full((2, 2), 7.0)}
    save_file({"a": want["a"]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({"b": want["b"], "c": want["c"]}, str(path / "model-00002-of-00002.safetensors"))
    write_index(path, {"a": "model-00001-of-00002.safetensors",
                       "b": "model-00002-of-00002.safetensors",
                       "c": "model-00002-of-00002.safetensors"})  # fmt: skip
    stale = {k: -v for k, v in want.items()}
    save_file(stale, str(path / "model.safetensors"))
    save_file({"a": stale["a"], "c": stale["c"]}, str(path / "model-00001-of-00003.safetensors"))
    return want


def test_with_an_index_each_tensor_comes_from_its_file_and_stale_copies_are_ignored(
    tmp_path: Path,
) -> None:
    want = sharded(tmp_path)
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    read(tmp_path, state)
    assert all(torch.equal(state[k], want[k]) for k in want)


def test_an_index_not_matching_its_files_is_refused_naming_it(tmp_path: Path) -> None:
    want = sharded(tmp_path)
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    # The index of another save: `c` mapped to the first shard, which does not hold it.
    write_index(tmp_path, {"a": "model-00001-of-00002.safetensors",
                           "b": "model-00002-of-00002.safetensors",
                           "c": "model-00001-of-00002.safetensors"})  # fmt: skip
    with pytest.raises(
        ValueError, match=r"maps 1 tensors to files that do not hold them: c"
    ) as err:
        read(tmp_path, state)
    assert str(tmp_path / INDEX_NAME) in str(err.value)
    # A shard the index names is gone (an upload that stopped part way).
    write_index(tmp_path, {"a": "model-00001-of-00002.safetensors",
                           "b": "model-00002-of-00002.safetensors",
                           "c": "model-00002-of-00002.safetensors"})  # fmt: skip
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        ValueError, match=r"names \['model-00002-of-00002.safetensors'\], not there"
    ):
        read(tmp_path, state)


def test_a_local_directory_follows_its_index_too(tmp_path: Path) -> None:
    """`load_safetensors` of a directory (source pvc/hub) uses the same reader: torch's
    HuggingFaceStorageReader would read the stale copies as well, the last one winning."""
    want = sharded(tmp_path)
    model = torch.nn.Module()
    for name, value in want.items():
        model.register_parameter(name, torch.nn.Parameter(torch.zeros_like(value)))
    assert load_safetensors(model, tmp_path) == {id(p) for p in model.parameters()}
    assert all(torch.equal(getattr(model, k).detach(), want[k]) for k in want)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        UnsupportedConfigError, match=r"spec\.model: cannot read the weights"
    ) as err:
        load_safetensors(model, tmp_path)
    assert "model-00002-of-00002.safetensors'], not there" in str(err.value)


# ---- requests, counted at the fsspec seam -------------------------------------------------


class Counted:
    """Wraps `fs.cat_ranges` (the call that becomes one GET per range on s3fs): records every
    range asked."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.original = fs.cat_ranges
        self.ranges: list[tuple[int, int]] = []

    def __call__(self, paths: list[str], starts: list[int], ends: list[int],
                 **kw: object) -> list[object]:  # fmt: skip
        self.ranges.extend(zip(starts, ends, strict=True))
        return list(self.original(paths, starts, ends, **kw))


def many_small(fs: fsspec.AbstractFileSystem) -> tuple[Location, dict[str, torch.Tensor]]:
    tensors = {f"layers.{i}.norm.weight": torch.full((64,), float(i)) for i in range(40)}
    root = f"/small-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(f"{root}/model.safetensors", save(tensors))
    return Location(fs, root, {}), tensors


@pytest.mark.parametrize(
    ("gap", "data_requests"), [(1 << 20, 1), (-1, 40)], ids=["coalesced", "one-each"]
)
def test_many_small_tensors_of_a_file_are_one_request(
    gap: int, data_requests: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = fsspec.filesystem("memory")
    location, want = many_small(fs)
    counted = Counted(fs)
    monkeypatch.setattr(fs, "cat_ranges", counted)
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    reader = RangedSafetensorsReader(location, gap_bytes=gap)
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert all(torch.equal(state[k], want[k]) for k in want)
    # The header's length and the header, then the data.
    assert len(counted.ranges) == 2 + data_requests == reader.requests
    # The whole file, once; nothing between the tensors to drop.
    assert reader.bytes_read == reader.bytes_total and reader.bytes_gaps == 0


def test_a_coalesced_read_respects_the_part_size(monkeypatch: pytest.MonkeyPatch) -> None:
    fs = fsspec.filesystem("memory")
    location, want = many_small(fs)
    counted = Counted(fs)
    monkeypatch.setattr(fs, "cat_ranges", counted)
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    # 10 tensors of 256 bytes per request of at most 2600 bytes.
    reader = RangedSafetensorsReader(location, part_bytes=2600)
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert all(torch.equal(state[k], want[k]) for k in want)
    data = counted.ranges[2:]
    assert len(data) == 4 and all(e - s == 2560 for s, e in data)
