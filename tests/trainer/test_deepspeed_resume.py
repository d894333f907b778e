"""The grouping of a DeepSpeed resume (finetune_trainer.deepspeed_resume), pure: groups within
the budget, in order, every tensor once, a larger tensor alone; which parameters a rank reads;
the chunked layout's chunks (deepspeed_layout). The grouped restore itself, and the bytes each
rank reads from storage, run under torchrun in test_deepspeed.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from finetune_operator.api.deepspeed_config import RESUME_CHUNK_BYTES, resume_chunk_budget
from finetune_trainer.deepspeed_fragments import owns_fragment
from finetune_trainer.deepspeed_layout import chunk_range, is_chunked, saved_shapes
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
