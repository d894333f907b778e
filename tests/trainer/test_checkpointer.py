"""The DCP checkpointer in one process (gloo, world 1): async save + commit, resume,
corrupt checkpoints skipped, retention, the no-op stand-in."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from finetune_operator.api.spec import CheckpointSpec
from finetune_operator.api.storage import ObjectStoreSpec
from finetune_trainer import checkpoint_store as store
from finetune_trainer.checkpointer import NoOpCheckpointer, build_checkpointer, save_due
from finetune_trainer.dcp_checkpointer import DcpCheckpointer
from finetune_trainer.location import Location, locate
from finetune_trainer.metrics import TrainerMetrics
from finetune_trainer.optim import build_scheduler
from finetune_trainer.sampler import StepSampler
from finetune_trainer.state import TrainState
from tests.objectstore import MotoServer
from tests.trainer.conftest import make_job


def new_state() -> TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = build_scheduler(opt, make_job().spec.training, total_steps=100)
    sampler = StepSampler(
        num_samples=50, global_batch=8, micro_batch_size=2, rank=0, world_size=1, seed=1
    )
    return TrainState(model, opt, sched, sampler, rank=0, seed=1)


def train_steps(state: TrainState, n: int, ckpt: DcpCheckpointer | None = None) -> None:
    for _ in range(n):
        state.sampler.next_step()
        loss = state.model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        if ckpt is not None:
            ckpt.wait_for_staging()
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad()
        state.step += 1
        if ckpt is not None:
            ckpt.maybe_save(state.step)


def L(path: Path) -> Location:
    return locate(str(path), "checkpoint.uri")


def checkpointer(
    state: TrainState,
    root: Path | str,
    group: dist.ProcessGroup,
    keep: int = 2,
    object_store: ObjectStoreSpec | None = None,
) -> DcpCheckpointer:
    spec = CheckpointSpec(uri=str(root), interval_steps=2, keep=keep)
    metrics = TrainerMetrics(
        job="t", rank=0, device=torch.device("cpu"), reforms=0, total_steps=100
    )
    return DcpCheckpointer(
        spec,
        state,
        group=group,
        world_size=1,
        metrics=metrics,
        meta={"job": "t"},
        object_store=object_store,
    )


def test_save_commit_resume_and_keep(tmp_path: Path, ckpt_group: dist.ProcessGroup) -> None:
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group)
    train_steps(state, 6, ckpt)
    assert ckpt.finish(timeout=30)
    ckpt.close()
    steps = [(c.step, c.committed) for c in store.list_checkpoints(L(tmp_path))]
    assert steps == [(4, True), (6, True)]  # keep 2
    assert store.read_marker(L(tmp_path / "step-00000006"))["worldSize"] == 1
    expected = {k: v.clone() for k, v in state.model.state_dict().items()}
    expected_lr = state.optimizer.param_groups[0]["lr"]
    rng_after = torch.get_rng_state()

    torch.manual_seed(123)  # a fresh process: other weights, other RNG
    fresh = new_state()
    torch.manual_seed(999)
    resumed = checkpointer(fresh, tmp_path, ckpt_group)
    assert resumed.load() == 6
    assert fresh.step == 6 and fresh.sampler.consumed == 48
    for k, v in fresh.model.state_dict().items():
        torch.testing.assert_close(v, expected[k])
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr)
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 6
    assert fresh.scheduler.last_epoch == 6
    # RNG restored to the state at the save of step 6, which was taken after step 6's draws.
    assert torch.equal(torch.get_rng_state(), rng_after)
    resumed.close()


def test_corrupt_newest_is_skipped_and_partial_cleaned(
    tmp_path: Path, ckpt_group: dist.ProcessGroup
) -> None:
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group, keep=3)
    train_steps(state, 6, ckpt)
    assert ckpt.finish(timeout=30)
    ckpt.close()
    data = next((tmp_path / "step-00000006").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:64])  # committed, then damaged on disk
    partial = tmp_path / "step-00000005"
    partial.mkdir()  # a save that never committed, older than a committed one
    newer = tmp_path / "step-00000008"
    newer.mkdir()  # newer than every committed one: perhaps a commit not seen yet (NFS)
    fresh = new_state()
    resumed = checkpointer(fresh, tmp_path, ckpt_group)
    assert resumed.load() == 4
    assert fresh.sampler.consumed == 32
    assert not partial.exists()
    assert newer.exists()  # left to the purge after a later commit passes it
    resumed.close()


def _flip_in_place(file: Path) -> None:
    """Damage without changing the size: what a structural check can never see."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    file.write_bytes(bytes(data))


def _saved_six(root: Path, group: dist.ProcessGroup) -> None:
    state = new_state()
    ckpt = checkpointer(state, root, group, keep=3)
    train_steps(state, 6, ckpt)
    assert ckpt.finish(timeout=30)
    ckpt.close()


def test_commit_writes_a_manifest_of_every_file(
    tmp_path: Path, ckpt_group: dist.ProcessGroup
) -> None:
    _saved_six(tmp_path, ckpt_group)
    path = tmp_path / "step-00000006"
    marker = store.read_marker(L(path))
    manifest = store.manifest_of(marker)
    assert marker is not None and marker["hash"] == "xxh3_128"
    on_disk = {f.name for f in path.iterdir() if f.name != "COMMITTED"}
    assert manifest is not None and set(manifest) == on_disk
    for name, entry in manifest.items():
        assert entry["size"] == (path / name).stat().st_size
        assert entry["xxh3_128"] == store.hash_file(L(path / name))


def test_corrupt_in_place_newest_falls_back_and_is_moved_aside(
    tmp_path: Path, ckpt_group: dist.ProcessGroup
) -> None:
    _saved_six(tmp_path, ckpt_group)
    newest = tmp_path / "step-00000006"
    _flip_in_place(next(newest.glob("*.distcp")))
    store.validate(L(newest))  # the structural check alone is fooled
    fresh = new_state()
    resumed = checkpointer(fresh, tmp_path, ckpt_group)
    assert resumed.load() == 4
    assert resumed.resumed_from_step == 4 and resumed.skipped == [6]
    assert fresh.step == 4 and fresh.sampler.consumed == 32
    assert resumed.metrics.resumed_from_step._value.get() == 4
    assert resumed.metrics.skipped_ckpt_step._value.get() == 6
    assert not newest.exists() and (tmp_path / "step-00000006.corrupt").is_dir()
    assert [c.step for c in store.list_checkpoints(L(tmp_path))] == [2, 4]
    resumed.close()


def test_any_load_exception_falls_back(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP reports failures as CheckpointException, a BaseException: still a fallback."""
    from torch.distributed.checkpoint.api import CheckpointException

    _saved_six(tmp_path, ckpt_group)
    real_load = dcp.load

    def failing_load(sd: dict[str, object], *, storage_reader: object, **kw: object) -> None:
        if str(storage_reader.path).endswith("step-00000006"):  # type: ignore[attr-defined]
            raise CheckpointException("load", {0: (RuntimeError("bad"), None)})
        real_load(sd, storage_reader=storage_reader, **kw)

    monkeypatch.setattr(dcp, "load", failing_load)
    fresh = new_state()
    resumed = checkpointer(fresh, tmp_path, ckpt_group)
    assert resumed.load() == 4 and resumed.skipped == [6]
    resumed.close()


def test_interrupt_during_load_is_not_swallowed(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved_six(tmp_path, ckpt_group)

    def interrupted(*args: object, **kw: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp, "load", interrupted)
    resumed = checkpointer(new_state(), tmp_path, ckpt_group)
    with pytest.raises(KeyboardInterrupt):
        resumed.load()
    resumed.close()


def test_complete_but_uncommitted_save_is_never_loaded(
    tmp_path: Path, ckpt_group: dist.ProcessGroup
) -> None:
    """A crash during an async save, after every byte was written but before the commit:
    the data is all there, the marker is not, so it is not a checkpoint."""
    _saved_six(tmp_path, ckpt_group)
    shutil.copytree(tmp_path / "step-00000006", tmp_path / "step-00000008")
    (tmp_path / "step-00000008" / "COMMITTED").unlink()
    fresh = new_state()
    resumed = checkpointer(fresh, tmp_path, ckpt_group)
    assert resumed.load() == 6 and resumed.skipped == []
    # Newer than every committed step: left at start (cleanup_plan), never loaded.
    assert (tmp_path / "step-00000008").exists()
    resumed.close()


def test_marker_without_manifest_still_loads(tmp_path: Path, ckpt_group: dist.ProcessGroup) -> None:
    """Checkpoints committed before manifests existed: structure checked, then loaded."""
    _saved_six(tmp_path, ckpt_group)
    path = tmp_path / "step-00000006"
    marker = store.read_marker(L(path))
    assert marker is not None
    marker.pop("files")
    store.write_marker(L(path), marker)
    resumed = checkpointer(new_state(), tmp_path, ckpt_group)
    assert resumed.load() == 6
    resumed.close()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        pytest.param(lambda f: f.write_bytes(f.read_bytes() + b"x"), "bytes", id="grown"),
        pytest.param(lambda f: f.unlink(), "-1 bytes", id="missing"),
        pytest.param(_flip_in_place, "hash", id="flipped"),
    ],
)
def test_verify_files_names_the_damage(
    tmp_path: Path, ckpt_group: dist.ProcessGroup, damage: Callable[[Path], object], message: str
) -> None:
    _saved_six(tmp_path, ckpt_group)
    path = tmp_path / "step-00000006"
    manifest = store.manifest_of(store.read_marker(L(path)))
    assert manifest is not None
    store.verify_files(L(path), manifest, manifest)
    data = next(path.glob("*.distcp"))
    damage(data)
    with pytest.raises(store.CorruptCheckpointError, match=message) as err:
        store.verify_files(L(path), manifest, manifest)
    assert data.name in str(err.value)


def test_share_of_covers_every_file_once() -> None:
    names = [f"__{i}_0.distcp" for i in range(5)] + [".metadata"]
    shares = [store.share_of(names, r, 4) for r in range(4)]
    assert sorted(n for s in shares for n in s) == sorted(names)


def test_nothing_usable_starts_at_zero(tmp_path: Path, ckpt_group: dist.ProcessGroup) -> None:
    bad = tmp_path / "step-00000002"
    bad.mkdir()
    store.write_marker(L(bad), {"step": 2})  # committed marker, no data at all
    state = new_state()
    ckpt = checkpointer(state, tmp_path, ckpt_group)
    assert ckpt.load() == 0 and state.step == 0
    ckpt.close()


def test_disabled_checkpointing_is_a_noop(ckpt_group: dist.ProcessGroup) -> None:
    metrics = TrainerMetrics(job="t", rank=0, device=torch.device("cpu"), reforms=0, total_steps=1)
    ck = build_checkpointer(
        CheckpointSpec(enabled=False),
        new_state(),
        group=ckpt_group,
        world_size=1,
        metrics=metrics,
        meta={},
    )
    assert isinstance(ck, NoOpCheckpointer) and ck.load() == 0 and ck.finish()


def test_default_spec_checkpoints_on_a_time_interval(
    tmp_path: Path, ckpt_group: dist.ProcessGroup
) -> None:
    """A job that says nothing about checkpoints still saves (time-based), so it resumes and
    makes a final save on SIGTERM."""
    spec = CheckpointSpec(uri=str(tmp_path))
    assert spec.interval_steps is None and spec.interval_minutes == 30.0
    metrics = TrainerMetrics(job="t", rank=0, device=torch.device("cpu"), reforms=0, total_steps=1)
    ck = build_checkpointer(
        spec, new_state(), group=ckpt_group, world_size=1, metrics=metrics, meta={}
    )
    assert not isinstance(ck, NoOpCheckpointer)
    assert not ck.time_due()  # not before the interval
    ck.close()


@pytest.mark.parametrize(
    ("step", "interval", "time_due", "last", "expected"),
    [
        (10, 10, False, 0, True),
        (11, 10, False, 10, False),
        (11, 10, True, 10, True),
        (10, 10, True, 10, False),
        (0, 10, True, 0, False),
        (7, None, False, 0, False),
    ],
)
def test_save_policy(
    step: int, interval: int | None, time_due: bool, last: int, expected: bool
) -> None:
    assert save_due(step, interval_steps=interval, time_due=time_due, last_saved=last) is expected


def test_through_s3_save_commit_prune_skip_corrupt_and_resume(
    ckpt_group: dist.ProcessGroup, s3_credentials: MotoServer
) -> None:
    """The same checkpointer on s3:// (moto's server over HTTP): async saves committed with a
    manifest, keep-last-K, a partial save cleaned, a newest checkpoint damaged in place
    skipped for the previous one and moved aside, and the state restored."""
    object_store = s3_credentials.spec()
    uri = f"s3://{s3_credentials.new_bucket()}/ckpt/job"
    state = new_state()
    ckpt = checkpointer(state, uri, ckpt_group, keep=2, object_store=object_store)
    train_steps(state, 6, ckpt)
    assert ckpt.finish(timeout=60)
    ckpt.close()
    root = ckpt.root
    assert not root.is_local and root.url == uri
    assert [(c.step, c.committed) for c in store.list_checkpoints(root)] == [(4, True), (6, True)]
    marker = store.read_marker(root / "step-00000004")
    manifest = store.manifest_of(marker)
    assert marker is not None and manifest is not None and marker["step"] == 4
    assert set(manifest) == set((root / "step-00000004").sizes()) - {"COMMITTED"}
    expected = {k: v.clone() for k, v in state.model.state_dict().items()}

    # The newest one damaged in place (same size); a save of step 5 that never committed.
    newest = root / "step-00000006"
    data = newest / next(n for n in newest.sizes() if n.endswith(".distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_atomic(bytes(raw))
    (root / "step-00000005" / "__0_0.distcp").write_atomic(b"half an upload")

    fresh = new_state()
    resumed = checkpointer(fresh, uri, ckpt_group, object_store=object_store)
    assert resumed.load() == 4 and resumed.skipped == [6]
    assert fresh.step == 4 and fresh.sampler.consumed == 32
    assert [c.step for c in store.list_checkpoints(root)] == [4]
    assert (root / "step-00000006.corrupt" / ".metadata").is_file()
    # Training on from step 4 writes step 6 again; the first checkpoint's weights were right.
    train_steps(fresh, 2, resumed)
    assert resumed.finish(timeout=60)
    resumed.close()
    assert [c.step for c in store.committed_newest_first(root)] == [6, 4]
    third = new_state()
    again = checkpointer(third, uri, ckpt_group, object_store=object_store)
    assert again.load() == 6
    for k, v in third.model.state_dict().items():
        torch.testing.assert_close(v, fresh.model.state_dict()[k])
    assert set(expected) == set(third.model.state_dict())
    again.close()
