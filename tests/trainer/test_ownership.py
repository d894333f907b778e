"""Storage safety (issue 11.6): a checkpoint root belongs to one job; an output directory is
replaced only when it is empty or a previous export of the same job; nothing else is deleted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune_operator.reconcile.progress import parse_trainer_error
from finetune_trainer import checkpoint_store as store
from finetune_trainer.export import FINISHED_MARKER
from finetune_trainer.ownership import (
    OWNER_FILE,
    StorageRefusedError,
    check_output_target,
    claim_checkpoint_root,
    read_owner,
)
from tests.trainer.conftest import (
    Proc,
    free_port,
    make_job,
    standalone_args,
    tail,
    trainer_env,
    write_job,
)

JOB_A = {"job": "alpha", "namespace": "team", "uid": "uid-a"}
JOB_B = {"job": "beta", "namespace": "team", "uid": "uid-b"}
JOB_A_RECREATED = {**JOB_A, "uid": "uid-a2"}


def test_first_use_writes_the_owner_and_the_owner_may_come_back(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    claim_checkpoint_root(root, JOB_A)
    assert read_owner(root) == {"job": "alpha", "namespace": "team", "uid": "uid-a"}
    claim_checkpoint_root(root, JOB_A)  # a restart of the same job
    assert [p.name for p in root.iterdir()] == [OWNER_FILE]


def test_a_second_job_is_refused_and_its_checkpoints_are_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    claim_checkpoint_root(root, JOB_A)
    (store.step_dir(root, 10)).mkdir()  # an uncommitted save of job A, in flight
    with pytest.raises(StorageRefusedError, match=r"belongs to job team/alpha \(uid uid-a\)"):
        claim_checkpoint_root(root, JOB_B)
    assert store.step_dir(root, 10).is_dir() and read_owner(root)["uid"] == "uid-a"  # type: ignore[index]


def test_a_job_recreated_under_the_same_name_resumes_its_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    claim_checkpoint_root(root, JOB_A)
    claim_checkpoint_root(root, JOB_A_RECREATED)
    assert read_owner(root)["uid"] == "uid-a2"  # type: ignore[index]
    with pytest.raises(StorageRefusedError):
        claim_checkpoint_root(root, {**JOB_A, "namespace": "other"})


def test_an_unreadable_owner_file_is_not_ours(tmp_path: Path) -> None:
    (tmp_path / OWNER_FILE).write_text("{garbage")
    with pytest.raises(StorageRefusedError, match="job \\?/\\?"):
        claim_checkpoint_root(tmp_path, JOB_A)


def _export(root: Path, meta: dict[str, str]) -> None:
    root.mkdir(parents=True)
    (root / "model.safetensors").write_bytes(b"weights")
    (root / FINISHED_MARKER).write_text(json.dumps({**meta, "step": 5}))


def test_output_absent_empty_or_our_own_export_may_be_replaced(tmp_path: Path) -> None:
    check_output_target(tmp_path / "absent", JOB_A, FINISHED_MARKER)
    (tmp_path / "empty").mkdir()
    check_output_target(tmp_path / "empty", JOB_A, FINISHED_MARKER)
    _export(tmp_path / "ours", JOB_A)
    check_output_target(tmp_path / "ours", JOB_A, FINISHED_MARKER)
    check_output_target(tmp_path / "ours", JOB_A_RECREATED, FINISHED_MARKER)


def test_output_holding_anything_else_is_refused(tmp_path: Path) -> None:
    user = tmp_path / "home"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    with pytest.raises(StorageRefusedError, match="not an export of this job"):
        check_output_target(user, JOB_A, FINISHED_MARKER)
    _export(tmp_path / "theirs", JOB_B)
    with pytest.raises(StorageRefusedError, match="export of job team/beta"):
        check_output_target(tmp_path / "theirs", JOB_A, FINISHED_MARKER)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageRefusedError, match="not a directory"):
        check_output_target(tmp_path / "file", JOB_A, FINISHED_MARKER)
    assert (user / "thesis.tex").read_text() == "years of work"


@pytest.mark.slow
def test_the_trainer_refuses_another_jobs_checkpoints_and_reports_it(
    tmp_path: Path, procs: list[Proc]
) -> None:
    # A real trainer under torchrun, pointed at a checkpoint root another job owns: it exits
    # with the refusal in its termination report (which the operator turns into
    # Failed/TrainerRefused) and leaves the other job's checkpoints alone.
    root = tmp_path / "checkpoints" / "quickstart"
    claim_checkpoint_root(root, {"job": "other", "namespace": "default", "uid": "other-uid"})
    theirs = store.step_dir(root, 10)
    theirs.mkdir()
    (theirs / "data").write_text("the other job's")
    report = tmp_path / "termination-log"
    report.touch()
    job = write_job(tmp_path / "job.json", make_job(training={"maxSteps": 6}))
    p = Proc(standalone_args(1, job, free_port()), cwd=tmp_path, log=tmp_path / "t.log",
             env=trainer_env("127.0.0.1", FT_TERMINATION_LOG=str(report)))  # fmt: skip
    procs.append(p)
    assert p.wait(180) != 0, tail(p.log)
    error = parse_trainer_error(report.read_text())
    assert error is not None and "belongs to job default/other (uid other-uid)" in error
    assert (theirs / "data").read_text() == "the other job's"
    assert read_owner(root)["uid"] == "other-uid"  # type: ignore[index]
