"""Checkpoint discovery, validation and retention on real DCP directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from finetune_trainer import checkpoint_store as store
from finetune_trainer.errors import UnsupportedConfigError


def make(root: Path, step: int, *, committed: bool = True) -> Path:
    path = store.step_dir(root, step)
    dcp.save({"w": torch.arange(1000.0) + step, "meta": "x"}, checkpoint_id=path, no_dist=True)
    if committed:
        store.write_marker(path, {"step": step})
    return path


def test_layout_and_newest_committed(tmp_path: Path) -> None:
    for s in (10, 20):
        make(tmp_path, s)
    make(tmp_path, 30, committed=False)
    (tmp_path / "not-a-step").mkdir()
    assert (tmp_path / "step-00000020").is_dir()
    assert [c.step for c in store.committed_newest_first(tmp_path)] == [20, 10]
    assert store.read_marker(tmp_path / "step-00000020") == {"step": 20}


def test_partial_dirs_are_removed(tmp_path: Path) -> None:
    make(tmp_path, 10)
    make(tmp_path, 20, committed=False)
    removed = store.remove_partial(tmp_path)
    assert removed == [tmp_path / "step-00000020"]
    assert [c.step for c in store.list_checkpoints(tmp_path)] == [10]


def test_purge_keeps_last_k_and_older_partials(tmp_path: Path) -> None:
    for s in (10, 20, 30, 40):
        make(tmp_path, s)
    make(tmp_path, 15, committed=False)
    make(tmp_path, 50, committed=False)  # in flight: newer than the commit, must stay
    store.purge(tmp_path, keep=2, below_step=40)
    assert [(c.step, c.committed) for c in store.list_checkpoints(tmp_path)] == [
        (30, True), (40, True), (50, False),
    ]


def test_valid_checkpoint_passes(tmp_path: Path) -> None:
    store.validate(make(tmp_path, 10))


@pytest.mark.parametrize("damage", ["truncate-data", "delete-data", "garble-metadata", "no-metadata"])
def test_corrupt_checkpoint_is_detected(tmp_path: Path, damage: str) -> None:
    path = make(tmp_path, 10)
    data = next(path.glob("*.distcp"))
    if damage == "truncate-data":
        data.write_bytes(data.read_bytes()[:100])
    elif damage == "delete-data":
        data.unlink()
    elif damage == "garble-metadata":
        (path / ".metadata").write_bytes(b"not a pickle")
    else:
        (path / ".metadata").unlink()
    with pytest.raises(store.CorruptCheckpointError):
        store.validate(path)


def test_marker_is_json_and_atomic(tmp_path: Path) -> None:
    store.write_marker(tmp_path, {"step": 3, "worldSize": 2})
    assert json.loads((tmp_path / "COMMITTED").read_text())["worldSize"] == 2
    assert not list(tmp_path.glob(".*tmp"))


def test_relative_uri_resolves_against_cwd(tmp_path: Path) -> None:
    assert store.resolve_root("checkpoints/q", tmp_path) == tmp_path / "checkpoints/q"
    assert store.resolve_root("/abs/q", tmp_path) == Path("/abs/q")
    assert store.resolve_root("file:///abs/q", tmp_path) == Path("/abs/q")
    with pytest.raises(UnsupportedConfigError, match="object storage"):
        store.resolve_root("s3://bucket/q", tmp_path)
