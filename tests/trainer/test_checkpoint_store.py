"""Checkpoint discovery, validation and retention on real DCP directories, on a local
filesystem and in an S3-compatible object store (moto's server, over HTTP): one code path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from finetune_trainer import checkpoint_store as store
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.location import Location, locate
from tests.objectstore import MotoServer


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    if request.param == "local":
        return locate(str(tmp_path), "checkpoint.uri")
    server: MotoServer = request.getfixturevalue("s3_credentials")
    uri = f"s3://{server.new_bucket()}/checkpoints/job"
    return store.resolve_root(uri, object_store=server.spec())


def make(root: Location, step: int, *, committed: bool = True) -> Location:
    path = store.step_dir(root, step)
    root.makedirs()
    state = {"w": torch.arange(1000.0) + step, "meta": "x"}
    dcp.save(state, storage_writer=path.dcp_writer(), no_dist=True)
    if committed:
        store.write_marker(path, {"step": step})
    return path


def _names(root: Location) -> list[tuple[int, bool]]:
    return [(c.step, c.committed) for c in store.list_checkpoints(root)]


def test_layout_and_newest_committed(root: Location) -> None:
    for s in (10, 20):
        make(root, s)
    make(root, 30, committed=False)
    (root / "not-a-step" / "x").write_atomic(b"x")
    assert (root / "step-00000020").is_dir()
    assert [c.step for c in store.committed_newest_first(root)] == [20, 10]
    assert store.read_marker(root / "step-00000020") == {"step": 20}


def test_partial_dirs_are_removed(root: Location) -> None:
    make(root, 5, committed=False)
    make(root, 10)
    make(root, 20, committed=False)
    removed = store.remove_partial(root)
    assert removed == [root / "step-00000005"]
    # Newer than every committed step: maybe a commit this view does not show yet (NFS).
    assert _names(root) == [(10, True), (20, False)]
    assert not (root / "step-00000005").exists()


def test_purge_keeps_last_k_and_older_partials(root: Location) -> None:
    for s in (10, 20, 30, 40):
        make(root, s)
    make(root, 15, committed=False)
    make(root, 50, committed=False)  # in flight: newer than the commit, must stay
    store.purge(root, keep=2, below_step=40)
    assert _names(root) == [(30, True), (40, True), (50, False)]


def test_valid_checkpoint_passes(root: Location) -> None:
    store.validate(make(root, 10))


@pytest.mark.parametrize(
    "damage", ["truncate-data", "delete-data", "garble-metadata", "no-metadata"]
)
def test_corrupt_checkpoint_is_detected(root: Location, damage: str) -> None:
    path = make(root, 10)
    data = path / next(n for n in path.sizes() if n.endswith(".distcp"))
    if damage == "truncate-data":
        data.write_atomic(data.read_bytes()[:100])
    elif damage == "delete-data":
        data.remove()
    elif damage == "garble-metadata":
        (path / ".metadata").write_atomic(b"not a pickle")
    else:
        (path / ".metadata").remove()
    with pytest.raises(store.CorruptCheckpointError):
        store.validate(path)


def test_quarantine_moves_the_step_out_of_the_listing(root: Location) -> None:
    make(root, 10)
    path = make(root, 20)
    moved = store.quarantine(path)
    assert moved == root / "step-00000020.corrupt" and moved.is_dir()
    assert not (moved / "COMMITTED").exists() and (moved / ".metadata").is_file()
    assert _names(root) == [(10, True)]


def test_marker_is_json_and_atomic(root: Location) -> None:
    store.write_marker(root, {"step": 3, "worldSize": 2})
    assert json.loads((root / "COMMITTED").read_text())["worldSize"] == 2
    assert [e.name for e in root.children()] == ["COMMITTED"]  # no temp file left


def test_uris_resolve(tmp_path: Path, s3_server: MotoServer) -> None:
    assert store.resolve_root("checkpoints/q", tmp_path).local_path == tmp_path / "checkpoints/q"
    assert store.resolve_root("/abs/q", tmp_path).local_path == Path("/abs/q")
    assert store.resolve_root("file:///abs/q", tmp_path).local_path == Path("/abs/q")
    s3 = store.resolve_root("s3://bucket/q/", object_store=s3_server.spec())
    assert (s3.url, s3.is_local, str(s3 / "step-00000001")) == (
        "s3://bucket/q",
        False,
        "s3://bucket/q/step-00000001",
    )
    with pytest.raises(UnsupportedConfigError, match=r"checkpoint.uri 'gs://b/q': only s3://"):
        store.resolve_root("gs://b/q", tmp_path)


def test_removing_a_step_leaves_siblings_that_share_its_prefix(root: Location) -> None:
    # On an object store a "directory" is a key prefix: step-00000006 must not take
    # step-00000006.corrupt or step-000000060 with it.
    for name in ("step-00000006", "step-00000006.corrupt", "step-000000060"):
        (root / name / "__0_0.distcp").write_atomic(b"x")
    (root / "step-00000006").remove()
    assert sorted(e.name for e in root.children()) == ["step-00000006.corrupt", "step-000000060"]
