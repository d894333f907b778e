"""Attacks on the resume path (gloo, world 1, real DCP checkpoints of a tiny model): every kind
of damage is skipped for the previous good checkpoint and named in the log; a read that fails
without damage does not throw a good checkpoint away; the DCP metadata is read once per
checkpoint tried (DCP's rank-local retry never runs); retention never deletes what a resume
loaded for a checkpoint it could not read."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from finetune_trainer import checkpoint_store as store
from finetune_trainer.checkpoint_store import CheckpointDir
from finetune_trainer.dcp_resume import DAMAGED, OK, UNREADABLE, PartlyLoadedError, worst
from finetune_trainer.location import Location
from tests.trainer.test_checkpointer import L, _saved_six, checkpointer, new_state

STEP6 = "step-00000006"


def _shard(path: Path) -> Path:
    return next(path.glob("*.distcp"))


def _meta_from_step4(path: Path) -> None:
    shutil.copyfile(path.parent / "step-00000004" / ".metadata", path / ".metadata")


DAMAGE: dict[str, Callable[[Path], object]] = {
    "shard-truncated": lambda p: _shard(p).write_bytes(_shard(p).read_bytes()[:100]),
    "shard-empty": lambda p: _shard(p).write_bytes(b""),
    "shard-deleted": lambda p: _shard(p).unlink(),
    "metadata-missing": lambda p: (p / ".metadata").unlink(),
    "metadata-empty": lambda p: (p / ".metadata").write_bytes(b""),
    "metadata-garbage": lambda p: (p / ".metadata").write_bytes(b"\x80\x04garbage" * 10),
    "metadata-of-another-step": _meta_from_step4,
    "marker-empty": lambda p: (p / "COMMITTED").write_bytes(b""),
    "marker-garbage": lambda p: (p / "COMMITTED").write_bytes(b"{not json"),
    "marker-not-a-record": lambda p: (p / "COMMITTED").write_text("[1, 2]"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_every_damage_falls_back_named_in_the_log_and_moved_aside(
    tmp_path: Path,
    ckpt_group: dist.ProcessGroup,
    damage: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The marker attacks loaded step 6 before: an unreadable marker was taken for the
    older manifest-less format, and the checkpoint loaded on the structure check alone."""
    _saved_six(tmp_path, ckpt_group)
    DAMAGE[damage](tmp_path / STEP6)
    fresh = new_state()
    resumed = checkpointer(fresh, tmp_path, ckpt_group)
    with caplog.at_level(logging.WARNING, logger="finetune_trainer.dcp_resume"):
        assert resumed.load() == 4
    resumed.close()
    assert resumed.skipped == [6] and fresh.step == 4
    assert resumed.metrics.skipped_ckpt_step._value.get() == 6
    skip = [
        r.getMessage() for r in caplog.records if "skipped damaged checkpoint" in r.getMessage()
    ]
    assert len(skip) == 1 and "step 6" in skip[0] and "rank 0: " in skip[0]  # the step, why
    assert (tmp_path / f"{STEP6}.corrupt").is_dir() and not (tmp_path / STEP6).exists()


def test_a_step_directory_under_another_steps_name_is_not_loaded(
    tmp_path: Path, ckpt_group: dist.ProcessGroup
) -> None:
    """Step 6 copied as step 8 (a sync gone wrong): every file matches its manifest, but the
    marker is step 6's. Before, it loaded as step 8 with step 6's sampler and schedule."""
    _saved_six(tmp_path, ckpt_group)
    shutil.copytree(tmp_path / STEP6, tmp_path / "step-00000008")
    resumed = checkpointer(new_state(), tmp_path, ckpt_group)
    assert resumed.load() == 6 and resumed.skipped == [8]
    resumed.close()
    assert (tmp_path / "step-00000008.corrupt").is_dir()


def test_a_partial_save_that_cannot_be_deleted_does_not_stop_the_resume(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed save left step 8 (no marker) where deletes are refused (a bucket policy
    without DeleteObject). Before, the refusal ended every start: the job could not resume."""
    _saved_six(tmp_path, ckpt_group)
    shutil.copytree(tmp_path / STEP6, tmp_path / "step-00000008")
    (tmp_path / "step-00000008" / "COMMITTED").unlink()
    real = Location.remove

    def refused(self: Location) -> None:
        if self.name == "step-00000008":
            raise PermissionError("AccessDenied: DeleteObject")
        real(self)

    monkeypatch.setattr(Location, "remove", refused)
    resumed = checkpointer(new_state(), tmp_path, ckpt_group)
    assert resumed.load() == 6 and resumed.skipped == []
    resumed.close()
    assert (tmp_path / "step-00000008").is_dir()


def test_a_read_failing_part_way_with_nothing_older_does_not_start_fresh_on_a_mixed_state(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only step 6 is there and its read fails after DCP has copied some tensors into the
    live model (a connection reset part-way). Before, the resume went on from step 0 with
    weights part step 6's, part initial, and step 6 was moved aside."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    _saved_six(tmp_path, ckpt_group)
    for old in ("step-00000002", "step-00000004"):
        shutil.rmtree(tmp_path / old)
    real = DefaultLoadPlanner.commit_tensor
    copied: list[object] = []

    def reset_after_one(self: DefaultLoadPlanner, read_item: Any, tensor: Any) -> None:
        if copied:
            raise ConnectionResetError("connection reset by peer")
        copied.append(read_item)
        real(self, read_item, tensor)

    monkeypatch.setattr(DefaultLoadPlanner, "commit_tensor", reset_after_one)
    resumed = checkpointer(new_state(), tmp_path, ckpt_group)
    with pytest.raises(PartlyLoadedError, match=r"checkpoint step 6 .* left in place"):
        resumed.load()
    resumed.close()
    assert copied  # the live state was written into
    assert [c.step for c in store.committed_newest_first(L(tmp_path))] == [6]


def test_a_failed_purge_does_not_fail_the_commit(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marker is written, then deleting old checkpoints fails (a bucket refusing a
    DELETE): the step is committed. Before, the save counted as failed (metric,
    `CheckpointFailing`, and a final save's exit code 3) while its marker was there."""

    def refused(*args: Any, **kwargs: Any) -> list[Location]:
        raise PermissionError("AccessDenied: DeleteObject")

    monkeypatch.setattr(store, "purge", refused)
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group)
    from tests.trainer.test_checkpointer import train_steps

    train_steps(state, 2, ckpt)
    assert ckpt.finish(timeout=30)
    ckpt.close()
    assert ckpt.last_committed_step == 2 and ckpt.last_failed_step == 0
    assert store.read_commit_marker(L(tmp_path / "step-00000002"))["step"] == 2


def test_a_failed_read_without_damage_leaves_the_checkpoint_in_place(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storage error during the load (a reset connection, a throttled bucket) after every
    check passed: the resume falls back, but the good checkpoint is not moved aside (it was,
    and every later resume lost it); the next resume, the storage well again, loads it."""
    _saved_six(tmp_path, ckpt_group)
    real_load = dcp.load

    def flaky_load(sd: dict[str, Any], *, storage_reader: Any, **kw: Any) -> None:
        if str(storage_reader.path).endswith(STEP6):
            raise ConnectionResetError("connection reset by peer")
        real_load(sd, storage_reader=storage_reader, **kw)

    monkeypatch.setattr(dcp, "load", flaky_load)
    first = checkpointer(new_state(), tmp_path, ckpt_group)
    assert first.load() == 4 and first.skipped == [6]
    first.close()
    assert not (tmp_path / f"{STEP6}.corrupt").exists()
    assert [c.step for c in store.committed_newest_first(L(tmp_path))] == [6, 4, 2]
    monkeypatch.setattr(dcp, "load", real_load)
    again = checkpointer(new_state(), tmp_path, ckpt_group)
    assert again.load() == 6 and again.skipped == []
    again.close()


def test_metadata_is_read_once_and_never_rank_locally(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storage whose metadata reads fail after the first (a flaky mount): the resume reads
    `.metadata` once, and DCP's load takes that copy. Before, every rank read it three times
    (structure check, shapes, DCP's load), and when DCP's read failed it retried it
    rank-locally (`__<rank>.metadata`) before the good checkpoint was skipped and moved aside."""
    _saved_six(tmp_path, ckpt_group)
    real = FileSystemReader.read_metadata
    calls: list[dict[str, Any]] = []

    def once(self: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        if len(calls) > 1:
            raise OSError("stale file handle")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemReader, "read_metadata", once)
    fresh = new_state()
    resumed = checkpointer(fresh, tmp_path, ckpt_group)
    assert resumed.load() == 6 and resumed.skipped == []
    resumed.close()
    assert calls == [{}]
    assert fresh.step == 6 and fresh.sampler.consumed == 48


def test_the_step_directory_is_listed_once(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's listing serves the structure check and every rank's manifest sizes: one
    view of the directory for every rank (before: each rank listed it twice, and a rank
    whose view lagged failed a good checkpoint as damaged)."""
    _saved_six(tmp_path, ckpt_group)
    real = Location.children
    listed: list[str] = []

    def counting(self: Location) -> Any:
        listed.append(self.name)
        return real(self)

    monkeypatch.setattr(Location, "children", counting)
    resumed = checkpointer(new_state(), tmp_path, ckpt_group)
    assert resumed.load() == 6
    resumed.close()
    assert listed.count(STEP6) == 1


def test_the_worst_verdict_of_any_rank_decides_and_names_its_rank() -> None:
    assert worst([(OK, ""), (OK, "")]) == (OK, "")
    assert worst([(UNREADABLE, "timeout"), (DAMAGED, "hash"), (DAMAGED, "size")]) == (
        DAMAGED, "rank 1: hash",
    )  # fmt: skip
    assert worst([(OK, ""), (UNREADABLE, "reset")]) == (UNREADABLE, "rank 1: reset")


def _dirs(*steps: tuple[int, bool]) -> list[CheckpointDir]:
    return [CheckpointDir(s, L(Path(f"/ck/step-{s:08d}")), c) for s, c in steps]


@pytest.mark.parametrize(
    ("keep", "deleted"),
    [(1, [2]), (2, []), (3, [])],
)
def test_purge_never_counts_a_newer_step_the_resume_could_not_read(
    keep: int, deleted: list[int]
) -> None:
    """Resumed from 2 (6 unreadable, left in place), then 4 committed. Counting 6 among the
    newest, keep 1 deleted 4 (just committed) and 2 (the one loaded), keeping only the one no
    rank could read; keep 2 deleted 2."""
    listing = _dirs((2, True), (4, True), (6, True), (3, False), (8, False))
    doomed = store.purge_plan(sorted(listing, key=lambda c: c.step), keep, below_step=4)
    assert sorted(c.step for c in doomed if c.committed) == deleted
    assert [c.step for c in doomed if not c.committed] == [3]  # 8: a save in flight


def test_purge_after_a_skipped_newest_keeps_what_was_loaded(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the checkpointer: keep 1, step 6 unreadable at resume, resumed from 4; the
    save of step 5 commits and the purge keeps it (before: it deleted it and 4, leaving 6)."""
    _saved_six(tmp_path, ckpt_group)
    shutil.rmtree(tmp_path / "step-00000002")
    real_load = dcp.load

    def flaky_load(sd: dict[str, Any], *, storage_reader: Any, **kw: Any) -> None:
        if str(storage_reader.path).endswith(STEP6):
            raise TimeoutError("read timed out")
        real_load(sd, storage_reader=storage_reader, **kw)

    monkeypatch.setattr(dcp, "load", flaky_load)
    from tests.trainer.test_checkpointer import train_steps

    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group, keep=1)
    assert ckpt.load() == 4
    train_steps(state, 1)
    assert ckpt.maybe_save(5, force=True) and ckpt.finish(timeout=30)
    ckpt.close()
    listed = [(c.step, c.committed) for c in store.list_checkpoints(L(tmp_path))]
    assert listed == [(5, True), (6, True)]
    assert json.loads((tmp_path / "step-00000005" / "COMMITTED").read_text())["step"] == 5


def _killed_mid_save(uri: str, endpoint: str, port: int, flag: str) -> None:
    """A trainer whose async save of step 6 is SIGKILLed by the test while it writes: its
    shards uploaded, its `.metadata` and marker not (the write paused there for the kill)."""
    import datetime
    import os
    import time

    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from finetune_operator.api.storage import ObjectStoreSpec
    from tests.objectstore import CREDENTIALS
    from tests.trainer.test_checkpointer import train_steps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **CREDENTIALS)
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    real = FsspecWriter.write_data

    def write_then_wait(self: FsspecWriter, plan: Any, planner: Any) -> Any:
        written = real(self, plan, planner)
        if str(self.path).endswith(STEP6):
            written.wait()
            Path(flag).write_text("written")
            time.sleep(120)  # the kill comes here, mid-save
        return written

    FsspecWriter.write_data = write_then_wait  # type: ignore[method-assign]
    store_spec = ObjectStoreSpec(endpoint_url=endpoint, region="eu-west-1", path_style=True)
    state = new_state()
    ckpt = checkpointer(state, uri, dist.new_group(backend="gloo"), keep=3, object_store=store_spec)
    train_steps(state, 6, ckpt)
    ckpt.finish()


@pytest.mark.slow
def test_sigkill_during_an_async_save_to_s3_resumes_from_the_previous_one(
    tmp_path: Path, s3_credentials: Any, ckpt_group: dist.ProcessGroup
) -> None:
    """A real kill: the process is SIGKILLed while its async save of step 6 uploads. The
    bucket holds step 6's shards but no `.metadata` nor marker; the resume takes step 4 and
    leaves the partial prefix (newer than every committed step) to a later purge."""
    import os
    import signal
    import time

    import torch.multiprocessing as mp

    from tests.trainer.conftest import free_port

    server = s3_credentials
    uri = f"s3://{server.new_bucket()}/ckpt"
    flag = tmp_path / "written"
    ctx = mp.get_context("spawn")
    child = ctx.Process(
        target=_killed_mid_save, args=(uri, server.endpoint, free_port(), str(flag))
    )
    child.start()
    deadline = time.monotonic() + 90
    while not flag.exists() and child.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flag.exists(), f"the save never reached its write (exit code {child.exitcode})"
    os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    root = store.resolve_root(uri, object_store=server.spec())
    left = store.step_dir(root, 6).sizes()
    assert any(n.endswith(".distcp") for n in left) and ".metadata" not in left
    assert [(c.step, c.committed) for c in store.list_checkpoints(root)] == [
        (2, True), (4, True), (6, False),
    ]  # fmt: skip
    fresh = new_state()
    resumed = checkpointer(fresh, uri, ckpt_group, object_store=server.spec())
    assert resumed.load() == 4 and resumed.skipped == []
    resumed.close()
    assert fresh.step == 4 and fresh.sampler.consumed == 32
    # Newer than every committed step: left at start (checkpoint_store.cleanup_plan), never
    # loaded; the save of step 6 rewrites it, the purge after a commit past it deletes it.
    assert [(c.step, c.committed) for c in store.list_checkpoints(root)] == [
        (2, True), (4, True), (6, False),
    ]  # fmt: skip
