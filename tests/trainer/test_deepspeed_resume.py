"""The grouping of a DeepSpeed resume (finetune_trainer.deepspeed_resume), pure: groups within
the budget, in order, every tensor once, a larger tensor alone; which optimizer states a rank
reads. The grouped restore itself runs under torchrun in test_deepspeed.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from finetune_operator.api.deepspeed_config import RESUME_CHUNK_BYTES, resume_chunk_budget
from finetune_trainer.deepspeed_resume import Entry, owns_optimizer_fragment, plan_groups


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


def test_a_rank_reads_a_state_only_where_deepspeed_sets_it() -> None:
    """As safe_set_full_optimizer_state: ZeRO-3 (ds_id) on every rank; ZeRO-1/2 where the
    parameter overlaps this rank's partition (_hp_mapping not None)."""
    p = nn.Parameter(torch.zeros(2))
    assert not owns_optimizer_fragment(p)
    p._hp_mapping = None  # type: ignore[attr-defined]
    assert not owns_optimizer_fragment(p)
    p._hp_mapping = object()  # type: ignore[attr-defined]
    assert owns_optimizer_fragment(p)
    q = nn.Parameter(torch.zeros(0))
    q.ds_id = 3  # type: ignore[attr-defined]
    assert owns_optimizer_fragment(q)
