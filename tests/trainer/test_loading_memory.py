"""Loading at scale, measured: a 534M-parameter model loaded by FSDP ranks on CPU peaks, on
every rank, at its shard + one decoder layer + a constant (the whole model per rank before
meta loading: see bench/model_loading.py for the before/after figures)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.trainer.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from model_loading import bound, layer_bytes, load_peak, measure

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_loads_its_shard_plus_one_layer(tmp_path: Path, world: int) -> None:
    rows = measure(world, "new", tmp_path)
    assert len(rows) == world
    whole_model = sum(r["shard_bytes"] for r in rows)
    for row in rows:
        assert row["shard_bytes"] * world <= whole_model + world  # an even split
        assert load_peak(row) <= bound(row), (row, layer_bytes())
        # The bound is meaningful: well under the whole model the old path held per rank.
        assert bound(row) < 0.8 * whole_model
