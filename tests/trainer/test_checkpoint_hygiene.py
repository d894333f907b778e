"""Checkpoint folder hygiene and fencing (gloo, world 1, real DCP checkpoints of a tiny model):
a lagging view of the volume never makes the start-up cleanup or a purge delete a committed
checkpoint; quarantined `step-N.corrupt` folders are bounded; a writer of an earlier
incarnation (a pod left running on a cut-off node) neither saves, commits nor purges once a
newer incarnation has claimed the root."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch.distributed as dist

from finetune_trainer import checkpoint_store as store
from finetune_trainer.checkpoint_fence import (
    EPOCH_KEY,
    check_fence,
    claim_epoch,
    fenced_by,
    read_epoch,
    stale_branch,
)
from finetune_trainer.checkpoint_store import CheckpointDir
from finetune_trainer.location import Location
from tests.trainer.test_checkpoint_store import make
from tests.trainer.test_checkpointer import L, _saved_six, checkpointer, new_state, train_steps


def _dirs(*steps: tuple[int, bool]) -> list[CheckpointDir]:
    return [CheckpointDir(s, L(Path(f"/x/step-{s:08d}")), c) for s, c in steps]


def _lagging_markers(monkeypatch: pytest.MonkeyPatch, hidden: set[str]) -> None:
    """The view an NFS client's attribute cache gives: `stat` (the listing's `is_file`) says
    the markers of the `hidden` steps are absent; opening them finds them."""
    real = Location.is_file

    def lagging(self: Location) -> bool:
        if self.name == "COMMITTED" and self.parent.name in hidden:
            return False
        return real(self)

    monkeypatch.setattr(Location, "is_file", lagging)


def test_the_cleanup_plan_never_takes_a_step_newer_than_the_newest_committed() -> None:
    plan = store.cleanup_plan(_dirs((2, False), (4, True), (6, False), (8, False)))
    assert [c.step for c in plan] == [2]
    assert store.cleanup_plan(_dirs((2, False), (4, False))) == []  # nothing committed seen


def test_a_lagging_view_at_start_deletes_no_committed_checkpoint(
    tmp_path: Path,
    ckpt_group: dist.ProcessGroup,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Steps 2, 4, 6 committed; this node's view hides the markers of 6 (written moments
    before by the previous incarnation's rank 0 on another node) and of 2. Before: the
    start-up cleanup took both for partial saves and deleted them."""
    _saved_six(tmp_path, ckpt_group)
    partial = tmp_path / "step-00000003"
    partial.mkdir()  # a real partial save, older than a committed one: still removed
    _lagging_markers(monkeypatch, {"step-00000006", "step-00000002"})
    fresh = new_state()
    resumed = checkpointer(fresh, tmp_path, ckpt_group, keep=3)
    with caplog.at_level(logging.WARNING):
        assert resumed.load() == 4  # 6 looks uncommitted from here: not loaded, not deleted
    resumed.close()
    for step in (2, 6):
        assert (tmp_path / f"step-{step:08d}" / "COMMITTED").is_file()
    assert not partial.exists()
    assert "step-00000002: listed uncommitted, but its marker opens" in caplog.text


def test_a_purge_with_a_lagging_view_keeps_a_committed_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = L(tmp_path)
    for s in (10, 20, 30):
        make(root, s)
    make(root, 15, committed=False)
    _lagging_markers(monkeypatch, {"step-00000020"})
    removed = store.purge(root, keep=3, below_step=30)
    assert removed == [store.step_dir(root, 15)]  # the real partial one only
    assert (tmp_path / "step-00000020" / "COMMITTED").is_file()


def test_the_corrupt_plan_keeps_the_newest_few_and_needs_a_newer_commit() -> None:
    assert store.corrupt_plan([10, 30, 20, 40], newest_committed=50, keep=2) == [10, 20]
    assert store.corrupt_plan([10, 30, 20, 40], newest_committed=15, keep=2) == [10]
    assert store.corrupt_plan([10, 20], newest_committed=50, keep=2) == []
    assert store.corrupt_plan([10, 20, 30], newest_committed=5, keep=2) == []


def test_quarantined_folders_are_bounded_after_a_commit(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: `step-N.corrupt` folders were never deleted (one whole checkpoint each)."""
    for s in (1, 3, 5):
        (tmp_path / f"step-{s:08d}.corrupt").mkdir()
        (tmp_path / f"step-{s:08d}.corrupt" / "__0_0.distcp").write_bytes(b"x")
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group, keep=3)
    with caplog.at_level(logging.INFO):
        train_steps(state, 2, ckpt)  # commits step 2
        assert ckpt.finish(timeout=30)
    ckpt.close()
    left = sorted(p.name for p in tmp_path.glob("*.corrupt"))
    assert left == ["step-00000003.corrupt", "step-00000005.corrupt"]
    assert "purged checkpoint" in caplog.text and "step-00000001.corrupt" in caplog.text


def test_epochs_are_claimed_in_order_and_fence_older_writers(tmp_path: Path) -> None:
    root = L(tmp_path)
    assert read_epoch(root) == 0
    assert (claim_epoch(root), claim_epoch(root)) == (1, 2)
    assert fenced_by(1, 2) and not fenced_by(2, 2)
    check_fence(root, 2, "x")
    with pytest.raises(Exception, match="epoch 2, this writer's is 1"):
        check_fence(root, 1, "the commit of step 4")


def test_a_stale_writer_neither_saves_nor_purges_over_a_newer_incarnation(
    tmp_path: Path, ckpt_group: dist.ProcessGroup
) -> None:
    """Incarnation A (keep 1) is cut off after step 4; B resumes from 4 and commits 6. A,
    still running, reaches step 6 and then 8. Before: A's save removed B's marker of step 6
    and rewrote its files, and A's purge after step 8 deleted B's step 6."""
    stale_state = new_state()
    stale = checkpointer(stale_state, tmp_path, ckpt_group, keep=1)
    train_steps(stale_state, 4, stale)
    assert stale.finish(timeout=30)

    state = new_state()
    new = checkpointer(state, tmp_path, ckpt_group, keep=1)
    assert new.load() == 4 and new.epoch == 2
    train_steps(state, 2, new)
    assert new.finish(timeout=30)
    new.close()
    theirs = (tmp_path / "step-00000006" / "COMMITTED").read_text()
    assert store.read_marker(L(tmp_path / "step-00000006"))[EPOCH_KEY] == 2

    train_steps(stale_state, 4, stale)
    assert stale.finish(timeout=30)
    stale.close()
    assert stale.fenced and stale.last_failed_step == 6  # counted: CheckpointFailing
    assert [(c.step, c.committed) for c in store.list_checkpoints(L(tmp_path))] == [(6, True)]
    assert (tmp_path / "step-00000006" / "COMMITTED").read_text() == theirs


def test_a_writer_fenced_during_its_write_commits_and_purges_nothing(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newer incarnation claims the root while the stale writer's files are being
    written (after its check before the write): its commit is refused, nothing is purged."""
    state = new_state()
    stale = checkpointer(state, tmp_path, ckpt_group, keep=1)
    train_steps(state, 2, stale)
    assert stale.finish(timeout=30)
    real = store.describe_files

    def newer_claims_meanwhile(path: Location, names: list[str]) -> object:
        claim_epoch(L(tmp_path))
        return real(path, names)

    monkeypatch.setattr(store, "describe_files", newer_claims_meanwhile)
    train_steps(state, 2, stale)
    assert stale.finish(timeout=30)
    stale.close()
    assert stale.last_failed_step == 4 and stale.last_committed_step == 2
    assert [(c.step, c.committed) for c in store.list_checkpoints(L(tmp_path))] == [
        (2, True),
        (4, False),
    ]


def test_a_marker_of_an_abandoned_history_is_told_by_its_epoch() -> None:
    assert stale_branch({2: 1, 4: 1, 6: 2, 8: 2}) == []  # a resume from 4, then onwards
    assert stale_branch({2: 1, 4: 2, 6: 1, 8: 1}) == [6, 8]  # epoch 1 went on past 4
    assert stale_branch({2: None, 4: 2, 6: None, 8: 1}) == [8]  # older markers: no say


def test_resume_skips_a_step_a_fenced_writer_committed_over_a_newer_history(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, caplog: pytest.LogCaptureFixture
) -> None:
    """Steps 2, 4, 6 committed by epoch 1; step 4 then rewritten by epoch 2 (which resumed
    from 2), and 6 is epoch 1's, committed in the window after its last fence check. Before:
    the resume loaded 6, a history the job had abandoned."""
    _saved_six(tmp_path, ckpt_group)
    four = L(tmp_path / "step-00000004")
    store.write_marker(four, {**(store.read_marker(four) or {}), EPOCH_KEY: 2})
    fresh = new_state()
    resumed = checkpointer(fresh, tmp_path, ckpt_group, keep=3)
    with caplog.at_level(logging.WARNING):
        assert resumed.load() == 4
    resumed.close()
    assert "not resuming from checkpoint step 6" in caplog.text
    assert (tmp_path / "step-00000006" / "COMMITTED").is_file()  # left in place


@pytest.mark.parametrize("grace", [0.0, 3600.0])
def test_a_partial_save_left_at_start_goes_with_the_first_purge_after_the_grace(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch, grace: float
) -> None:
    """A save of step 9 cut short (newer than every committed step: left at start) is never
    reached again; without the deferred purge it stayed forever."""
    _saved_six(tmp_path, ckpt_group)
    partial = tmp_path / "step-00000009"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    monkeypatch.setenv("FT_CHECKPOINT_CLEANUP_GRACE_SECONDS", str(grace))
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group, keep=3)
    assert ckpt.load() == 6
    assert partial.exists()
    train_steps(state, 2, ckpt)  # commits step 8
    assert ckpt.finish(timeout=30)
    ckpt.close()
    assert partial.exists() == (grace > 0)


def test_a_root_where_no_epoch_can_be_claimed_still_resumes(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root this process cannot write (a read-only snapshot) resumes as before fencing;
    the first save claims the epoch (and, on a writable root, commits)."""
    import finetune_trainer.dcp_resume as dcp_resume

    _saved_six(tmp_path, ckpt_group)

    def refused(root: Location) -> int:
        raise PermissionError(f"{root}: read-only")

    monkeypatch.setattr(dcp_resume, "claim_epoch", refused)
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group, keep=3)
    assert ckpt.load() == 6 and ckpt.epoch is None
    train_steps(state, 2, ckpt)
    assert ckpt.finish(timeout=30)
    ckpt.close()
    assert ckpt.last_committed_step == 8 and ckpt.epoch == 2


def test_a_writer_whose_claim_failed_at_start_never_claims_over_a_newer_incarnation(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 2, 4, 6 committed by epoch 1. A resumes, but its claim fails (a transient error
    of the store); then B, the replacement of A's pod, claims epoch 2. A's first save must
    not claim epoch 3 over B: B would be fenced by the stale writer, which would go on
    saving. Before: A claimed 3 and committed 8."""
    import finetune_trainer.dcp_resume as dcp_resume

    _saved_six(tmp_path, ckpt_group)

    def transient(root: Location) -> int:
        raise OSError(f"{root}: 503 Slow Down")

    monkeypatch.setattr(dcp_resume, "claim_epoch", transient)
    state = new_state()
    stale = checkpointer(state, tmp_path, ckpt_group, keep=3)
    assert stale.load() == 6 and stale.epoch is None
    assert claim_epoch(L(tmp_path)) == 2  # B
    train_steps(state, 2, stale)
    assert stale.finish(timeout=30)
    stale.close()
    assert stale.fenced and stale.last_committed_step == 6
    assert read_epoch(L(tmp_path)) == 2
    assert [c.step for c in store.committed_newest_first(L(tmp_path))] == [6, 4, 2]


def test_a_writer_fenced_during_its_purge_stops_deleting(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 2, 4, 6 committed; the writer (keep 1) commits 8, and its purge of 2, 4 and 6
    is under way when a newer incarnation claims the root (after the first delete): the
    rest is kept (before: the whole purge ran on the check made before it)."""
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group, keep=3)
    train_steps(state, 6, ckpt)
    assert ckpt.finish(timeout=30)
    ckpt.spec = ckpt.spec.model_copy(update={"keep": 1})
    real = Location.remove

    def claimed_after_the_first_delete(self: Location) -> None:
        real(self)
        if self.name == "step-00000002":
            claim_epoch(L(tmp_path))

    monkeypatch.setattr(Location, "remove", claimed_after_the_first_delete)
    train_steps(state, 2, ckpt)
    assert ckpt.finish(timeout=30)
    ckpt.close()
    assert [c.step for c in store.committed_newest_first(L(tmp_path))] == [8, 6, 4]


def test_a_writer_fenced_during_its_purge_deletes_no_uncommitted_step(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 2, 4, 6 committed; a partial step 9 is left at start (deferred, no grace), and
    an uncommitted step 7 appears after the start's listing. The writer commits 8; its purge
    deletes step 2 and then a newer incarnation claims the root, whose saves of steps 7 and 9
    (it resumed from 6 too) those uncommitted folders may now be. Before: the guard ran only
    before committed steps, so 7 (purged as older than 8) and 9 (the deferred delete) went."""
    _saved_six(tmp_path, ckpt_group)
    partial = tmp_path / "step-00000009"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    monkeypatch.setenv("FT_CHECKPOINT_CLEANUP_GRACE_SECONDS", "0")
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group, keep=3)
    assert ckpt.load() == 6
    in_flight = tmp_path / "step-00000007"
    in_flight.mkdir()
    (in_flight / "__0_0.distcp").write_bytes(b"being written")
    real = Location.remove

    def claimed_after_the_first_delete(self: Location) -> None:
        real(self)
        if self.name == "step-00000002":
            claim_epoch(L(tmp_path))

    monkeypatch.setattr(Location, "remove", claimed_after_the_first_delete)
    train_steps(state, 2, ckpt)  # commits step 8
    assert ckpt.finish(timeout=30)
    ckpt.close()
    assert in_flight.exists() and partial.exists()
    assert [c.step for c in store.committed_newest_first(L(tmp_path))] == [8, 6, 4]


def test_the_cleanup_grace_is_read_from_the_environment_or_refused_by_name() -> None:
    from finetune_trainer.checkpoint_hygiene import CLEANUP_GRACE_SECONDS, cleanup_grace
    from finetune_trainer.errors import UnsupportedConfigError

    assert cleanup_grace({}) == CLEANUP_GRACE_SECONDS
    assert cleanup_grace({"FT_CHECKPOINT_CLEANUP_GRACE_SECONDS": "0"}) == 0.0
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(UnsupportedConfigError, match="FT_CHECKPOINT_CLEANUP_GRACE_SECONDS"):
            cleanup_grace({"FT_CHECKPOINT_CLEANUP_GRACE_SECONDS": bad})


MOUNTS = """\
overlay / overlay rw,relatime 0 0
proc /proc proc rw 0 0
/dev/sda1 /data ext4 rw,relatime 0 0
nfs.example:/ckpt /data/shared nfs4 rw,relatime,vers=4.1 0 0
/dev/sdb1 /data/shared/local\\040disk xfs rw 0 0
s3fs /mnt/bucket fuse.s3fs rw 0 0
"""


def test_the_filesystem_of_a_path_is_its_deepest_mount() -> None:
    from finetune_trainer.checkpoint_hygiene import filesystem_type

    assert filesystem_type("/data/shared/ckpt/step-00000004", MOUNTS) == "nfs4"
    assert filesystem_type("/data/shared", MOUNTS) == "nfs4"
    assert filesystem_type("/data/sharedx", MOUNTS) == "ext4"  # not inside /data/shared
    assert filesystem_type("/data/shared/local disk/ckpt", MOUNTS) == "xfs"  # \040: a space
    assert filesystem_type("/home/user", MOUNTS) == "overlay"
    assert filesystem_type("/x", "") is None
    # A later mount on the same point hides the earlier one.
    assert filesystem_type("/data/a", MOUNTS + "srv:/x /data nfs rw 0 0\n") == "nfs"


def test_the_grace_is_waited_only_where_a_view_can_lag() -> None:
    """A local disk is one node's: its view never lags, so a partial save newer than every
    committed step goes with the first purge (the fault drill's wait: 120 s for nothing)."""
    from finetune_trainer.checkpoint_hygiene import CLEANUP_GRACE_SECONDS, default_grace

    assert default_grace(L(Path("/data/ckpt")), MOUNTS) == 0.0
    assert default_grace(L(Path("/data/shared/ckpt")), MOUNTS) == CLEANUP_GRACE_SECONDS
    assert default_grace(L(Path("/mnt/bucket/ckpt")), MOUNTS) == CLEANUP_GRACE_SECONDS  # FUSE
    assert default_grace(L(Path("/data/ckpt")), None) == CLEANUP_GRACE_SECONDS  # unknown
    assert default_grace(L(Path("/data/ckpt")), "") == CLEANUP_GRACE_SECONDS


@pytest.mark.parametrize(("fstype", "purged"), [("ext4", True), ("nfs4", False)])
def test_the_checkpointer_takes_its_grace_from_the_roots_filesystem(
    tmp_path: Path,
    ckpt_group: dist.ProcessGroup,
    monkeypatch: pytest.MonkeyPatch,
    fstype: str,
    purged: bool,
) -> None:
    import finetune_trainer.dcp_checkpointer as dcp_checkpointer

    _saved_six(tmp_path, ckpt_group)
    partial = tmp_path / "step-00000009"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    monkeypatch.delenv("FT_CHECKPOINT_CLEANUP_GRACE_SECONDS", raising=False)
    mounts = f"overlay / overlay rw 0 0\nsrv:/x {tmp_path} {fstype} rw 0 0\n"
    monkeypatch.setattr(dcp_checkpointer, "read_mounts", lambda: mounts)
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group, keep=3)
    assert ckpt.load() == 6
    train_steps(state, 2, ckpt)  # commits step 8
    assert ckpt.finish(timeout=30)
    ckpt.close()
    assert partial.exists() != purged
