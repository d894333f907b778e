"""The grouping of a DeepSpeed resume (finetune_trainer.deepspeed_resume), pure: groups within
the budget, in order, every tensor once, a larger tensor alone; which parameters a rank reads;
the chunked layout's chunks and its shape check (deepspeed_layout). The grouped restore itself, and the bytes each
rank reads from storage, run under torchrun in test_deepspeed.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from finetune_operator.api.deepspeed_config import RESUME_CHUNK_BYTES, resume_chunk_budget
from finetune_trainer.checkpoint_compat import Shape, compare
from finetune_trainer.deepspeed_fragments import owns_fragment
from finetune_trainer.deepspeed_layout import (
    RangeLoadPlanner,
    chunk_range,
    comparable_shapes,
    is_chunked,
    saved_shapes,
)
from finetune_trainer.deepspeed_resume import Entry, plan_groups


def entries(*sizes: int) -> list[Entry]:
    return [Entry(i, "", n) for i, n in enumerate(sizes)]


@pytest.mark.parametrize(
    ("sizes", "budget", "groups"),
    [
        pytest.param((4, 4, 4), 8, [[0, 1], [2]], id="fills-to-the-budget"),
        pytest.param((4, 4, 4), 12, [[0, 1, 2]], id="all-in-one"),
        pytest.param((2, 10, 2), 8, [[0], [1], [2]], id="larger-tensor-alone"),
        pytest.param((8, 8), 8, [[0], [1]], id="exactly-the-budget"),
        pytest.param((), 8, [], id="nothing"),
    ],
)
def test_groups_keep_order_and_budget(
    sizes: tuple[int, ...], budget: int, groups: list[list[int]]
) -> None:
    got = plan_groups(entries(*sizes), budget)
    assert [[e.param for e in g] for g in got] == groups
    for g in got:
        assert len(g) == 1 or sum(e.nbytes for e in g) <= budget


def test_budget_is_the_cap_or_the_largest_tensor() -> None:
    assert resume_chunk_budget(10) == RESUME_CHUNK_BYTES == 2**30
    assert resume_chunk_budget(3 * 2**30) == 3 * 2**30  # an 8B's embedding is read whole


def test_a_rank_reads_a_parameter_only_where_it_holds_a_fragment() -> None:
    """As DeepSpeed's setters: ZeRO-3 (ds_id) on every rank; ZeRO-1/2 where the parameter
    overlaps this rank's partition (_hp_mapping not None)."""
    p = nn.Parameter(torch.zeros(2))
    assert not owns_fragment(p)
    p._hp_mapping = None  # type: ignore[attr-defined]
    assert not owns_fragment(p)
    p._hp_mapping = object()  # type: ignore[attr-defined]
    assert owns_fragment(p)
    q = nn.Parameter(torch.zeros(0))
    q.ds_id = 3  # type: ignore[attr-defined]
    assert owns_fragment(q)


@pytest.mark.parametrize("numel", [1, 3, 7, 8, 64, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_chunks_are_torch_chunk_and_zero3_partitions(numel: int, world: int) -> None:
    """Rank r's chunk is torch.chunk's (DTensor's Shard(0)) and ZeRO-3's partition: ceil-sized,
    contiguous, covering the tensor once, the last ones short or empty."""
    flat = torch.arange(numel)
    pieces = list(torch.chunk(flat, world)) + [flat[:0]] * world  # torch.chunk may give fewer
    covered = []
    for rank in range(world):
        start, length = chunk_range(numel, world, rank)
        assert torch.equal(flat[start : start + length], pieces[rank])
        assert length <= -(-numel // world)  # ZeRO-3's partition size, padding aside
        covered += flat[start : start + length].tolist()
    assert covered == flat.tolist()


def test_the_layout_is_told_by_the_keys() -> None:
    chunked = saved_shapes("w", torch.Size([4, 3]), ["exp_avg"], chunked=True)
    assert chunked == {"model.chunked.w": (12,), "optim.chunked.w.exp_avg": (12,)}
    whole = saved_shapes("w", torch.Size([4, 3]), ["exp_avg"], chunked=False)
    assert whole == {"model.w": (4, 3), "optim.w.exp_avg": (4, 3)}
    assert is_chunked({"train", *chunked}) and not is_chunked({"train", *whole})


STATES = ("exp_avg", "exp_avg_sq")


def mlp(hidden: int, intermediate: int) -> dict[str, torch.Size]:
    return {
        "mlp.up_proj.weight": torch.Size([intermediate, hidden]),
        "mlp.down_proj.weight": torch.Size([hidden, intermediate]),
    }


def side(params: dict[str, torch.Size], *, chunked: bool = True) -> dict[str, Shape]:
    """One side's shapes as DCP's metadata (the checkpoint) or expected_shapes (the job)
    list them."""
    shapes: dict[str, Shape] = {"train": None}
    for name, shape in params.items():
        shapes.update(saved_shapes(name, shape, STATES, chunked=chunked))
    return shapes


def record(params: dict[str, torch.Size]) -> dict[str, list[int]]:
    # Through JSON, as the COMMITTED marker holds it.
    loaded: dict[str, list[int]] = json.loads(json.dumps({n: list(s) for n, s in params.items()}))
    return loaded


def test_a_chunked_checkpoint_of_other_shapes_with_the_same_counts_is_refused() -> None:
    """hidden 64 / intermediate 128 against 128 / 64: the same names and element counts, the
    MLP's matrices transposed. The flattened tensors' metadata cannot tell them apart; the
    shapes the marker recorded do."""
    saved, job = mlp(64, 128), mlp(128, 64)
    assert compare(side(saved), side(job)) == []  # what counts alone would load
    differences = compare(*comparable_shapes(side(saved), side(job), record(saved), record(job)))
    assert len(differences) == 6  # each matrix's master and two states
    assert differences[0].describe() == (
        "model.chunked.mlp.up_proj.weight (checkpoint: [128, 64], this job: [64, 128])"
    )
    assert {d.key for d in differences} >= {"optim.chunked.mlp.down_proj.weight.exp_avg_sq"}


def test_the_same_shapes_are_compatible_and_a_count_still_differs() -> None:
    same = comparable_shapes(side(mlp(64, 128)), side(mlp(64, 128)), record(mlp(64, 128)),
                             record(mlp(64, 128)))  # fmt: skip
    assert compare(*same) == []
    # A resized parameter differs on its count whether or not the record says so.
    saved, job = mlp(64, 128), mlp(64, 96)
    differences = compare(*comparable_shapes(side(saved), side(job), record(saved), record(job)))
    assert differences[0].describe() == (
        "model.chunked.mlp.up_proj.weight (checkpoint: [128, 64], this job: [96, 64])"
    )
    assert compare(side(saved), side(job))  # and on counts alone


@pytest.mark.parametrize("saved_record", [None, "garbage", {"mlp.up_proj.weight": "x"}])
def test_a_chunked_checkpoint_without_a_record_is_compared_on_counts(saved_record: object) -> None:
    """Written before the record (or a record that holds no shape): loaded as before, on
    counts only; a parameter the record lacks is compared on counts on both sides."""
    saved, job = side(mlp(64, 128)), side(mlp(128, 64))
    comparable = comparable_shapes(saved, job, saved_record, record(mlp(128, 64)))
    assert comparable == (saved, job)
    assert compare(*comparable) == []
    partial = record(mlp(64, 128))
    del partial["mlp.down_proj.weight"]
    only_up = compare(*comparable_shapes(saved, job, partial, record(mlp(128, 64))))
    assert {d.key for d in only_up} == {
        "model.chunked.mlp.up_proj.weight",
        "optim.chunked.mlp.up_proj.weight.exp_avg",
        "optim.chunked.mlp.up_proj.weight.exp_avg_sq",
    }


def test_a_whole_layout_checkpoint_is_compared_on_its_full_shapes() -> None:
    saved, job = side(mlp(64, 128), chunked=False), side(mlp(128, 64), chunked=False)
    comparable = comparable_shapes(saved, job, record(mlp(64, 128)), record(mlp(128, 64)))
    assert comparable == (saved, job)  # nothing to unflatten: already full-shaped
    assert len(compare(*comparable)) == 6


def saved_in_chunks(numel: int, size: int) -> Metadata:
    """DCP's metadata of one flattened tensor `x` saved in chunks of `size` elements."""
    chunks = [ChunkStorageMetadata(torch.Size([o]), torch.Size([min(size, numel - o)]))
              for o in range(0, numel, size)]  # fmt: skip
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([numel]), chunks)
    return Metadata(state_dict_metadata={"x": md})


@pytest.mark.parametrize(
    ("start", "length", "read"),
    [
        pytest.param(0, 4, [(0, 0, 0, 4)], id="one-chunk-exactly"),
        pytest.param(3, 6, [(0, 3, 0, 1), (4, 0, 1, 4), (8, 0, 5, 1)], id="across-two-bounds"),
        pytest.param(9, 1, [(8, 1, 0, 1)], id="inside-the-last"),
        pytest.param(5, 0, [], id="nothing"),
    ],
)
def test_a_range_reads_only_the_saved_chunks_it_overlaps(
    start: int, length: int, read: list[tuple[int, int, int, int]]
) -> None:
    """A ZeRO-1/2 fragment [start, start+length) of a tensor of 10 elements saved in chunks of
    4: one read per overlapping saved chunk (saved chunk offset, offset in it, offset in the
    fragment, count); the other chunks are not read."""
    planner = RangeLoadPlanner({"x": start})
    planner.set_up_planner({"x": torch.empty(length)}, saved_in_chunks(10, 4))
    items = planner.create_local_plan().items
    got = [(i.storage_index.offset[0], i.storage_offsets[0], i.dest_offsets[0], i.lengths[0])
           for i in items]  # fmt: skip
    assert got == read


def test_a_range_outside_the_saved_tensor_is_refused_by_key() -> None:
    planner = RangeLoadPlanner({"x": 8})
    planner.set_up_planner({"x": torch.empty(3)}, saved_in_chunks(10, 4))
    with pytest.raises(ValueError, match=r"checkpoint key x: elements \[8, 11\) asked of a 10-"):
        planner.create_local_plan()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_range_is_read_from_a_real_checkpoint(tmp_path: Path) -> None:
    """Through DCP's own load (one process): the range's values land in the fragment."""
    whole = torch.arange(10, dtype=torch.float32)
    dcp.save({"x": whole}, checkpoint_id=tmp_path, no_dist=True)
    fragment = torch.zeros(4)
    dcp.load({"x": fragment}, checkpoint_id=tmp_path, planner=RangeLoadPlanner({"x": 5}),
             no_dist=True)  # fmt: skip
    assert fragment.tolist() == [5.0, 6.0, 7.0, 8.0]
