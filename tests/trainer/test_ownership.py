"""Storage safety (issue 11.6): a checkpoint root belongs to one job; an output directory is
replaced only when it is empty or a previous export of the same job; nothing else is deleted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune_operator.reconcile.progress import parse_trainer_error
from finetune_trainer import checkpoint_store as store
from finetune_trainer.export import FINISHED_MARKER
from finetune_trainer.location import Location, locate
from finetune_trainer.ownership import (
    OWNER_FILE,
    StorageRefusedError,
    check_output_target,
    claim_checkpoint_root,
    read_owner,
)
from finetune_trainer.refusal import EXIT_CONFIG_ERROR
from tests.objectstore import MotoServer
from tests.trainer.conftest import (
    Proc,
    launch_standalone,
    make_job,
    tail,
    write_job,
)

JOB_A = {"job": "alpha", "namespace": "team", "uid": "uid-a"}
JOB_B = {"job": "beta", "namespace": "team", "uid": "uid-b"}
JOB_A_RECREATED = {**JOB_A, "uid": "uid-a2"}


@pytest.fixture(params=["local", "s3"])
def base(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    """A directory on a volume, or a prefix in an S3-compatible store (moto's server)."""
    if request.param == "local":
        return locate(str(tmp_path), "checkpoint.uri")
    server: MotoServer = request.getfixturevalue("s3_credentials")
    return locate(f"s3://{server.new_bucket()}/base", "checkpoint.uri", object_store=server.spec())


def test_first_use_writes_the_owner_and_the_owner_may_come_back(base: Location) -> None:
    root = base / "ckpt"
    claim_checkpoint_root(root, JOB_A)
    assert read_owner(root) == {"job": "alpha", "namespace": "team", "uid": "uid-a"}
    claim_checkpoint_root(root, JOB_A)  # a restart of the same job
    assert [e.name for e in root.children()] == [OWNER_FILE]


def test_a_second_job_is_refused_and_its_checkpoints_are_left_alone(base: Location) -> None:
    root = base / "ckpt"
    claim_checkpoint_root(root, JOB_A)
    in_flight = store.step_dir(root, 10) / "__0_0.distcp"  # an uncommitted save of job A
    in_flight.write_atomic(b"data")
    with pytest.raises(StorageRefusedError, match=r"belongs to job team/alpha \(uid uid-a\)"):
        claim_checkpoint_root(root, JOB_B)
    assert in_flight.read_bytes() == b"data" and read_owner(root)["uid"] == "uid-a"  # type: ignore[index]


def test_a_job_recreated_under_the_same_name_resumes_its_checkpoints(base: Location) -> None:
    root = base / "ckpt"
    claim_checkpoint_root(root, JOB_A)
    claim_checkpoint_root(root, JOB_A_RECREATED)
    assert read_owner(root)["uid"] == "uid-a2"  # type: ignore[index]
    with pytest.raises(StorageRefusedError):
        claim_checkpoint_root(root, {**JOB_A, "namespace": "other"})


def test_an_unreadable_owner_file_is_not_ours(base: Location) -> None:
    (base / OWNER_FILE).write_atomic(b"{garbage")
    with pytest.raises(StorageRefusedError, match="job \\?/\\?"):
        claim_checkpoint_root(base, JOB_A)


def test_a_missing_bucket_is_a_refusal_naming_the_uri(s3_credentials: MotoServer) -> None:
    root = locate("s3://no-such-bucket/ckpt", "checkpoint.uri", object_store=s3_credentials.spec())
    with pytest.raises(
        StorageRefusedError, match=r"checkpoint\.uri s3://no-such-bucket/ckpt cannot"
    ):
        claim_checkpoint_root(root, JOB_A)


def _export(root: Location, meta: dict[str, str]) -> None:
    (root / "model.safetensors").write_atomic(b"weights")
    (root / FINISHED_MARKER).write_atomic(json.dumps({**meta, "step": 5}).encode())


def test_output_absent_empty_or_our_own_export_may_be_replaced(base: Location) -> None:
    check_output_target(base / "absent", JOB_A, FINISHED_MARKER)
    if base.is_local:  # an object store has no empty directories
        (base / "empty").makedirs()
        check_output_target(base / "empty", JOB_A, FINISHED_MARKER)
    _export(base / "ours", JOB_A)
    check_output_target(base / "ours", JOB_A, FINISHED_MARKER)
    check_output_target(base / "ours", JOB_A_RECREATED, FINISHED_MARKER)


def test_output_holding_anything_else_is_refused(base: Location) -> None:
    user = base / "home"
    (user / "thesis.tex").write_atomic(b"years of work")
    with pytest.raises(StorageRefusedError, match="not an export of this job"):
        check_output_target(user, JOB_A, FINISHED_MARKER)
    _export(base / "theirs", JOB_B)
    with pytest.raises(StorageRefusedError, match="export of job team/beta"):
        check_output_target(base / "theirs", JOB_A, FINISHED_MARKER)
    (base / "file").write_atomic(b"x")
    with pytest.raises(StorageRefusedError, match="not a directory"):
        check_output_target(base / "file", JOB_A, FINISHED_MARKER)
    assert (user / "thesis.tex").read_text() == "years of work"


@pytest.mark.slow
def test_the_trainer_refuses_another_jobs_checkpoints_and_reports_it(
    tmp_path: Path, procs: list[Proc]
) -> None:
    # A real trainer under torchrun, pointed at a checkpoint root another job owns: it exits
    # with the refusal in its termination report (which the operator turns into
    # Failed/TrainerRefused) and leaves the other job's checkpoints alone. torchrun, allowed
    # restarts, does not spend them on it: every attempt would refuse again (refusal.py).
    root = locate(str(tmp_path / "checkpoints" / "quickstart"), "checkpoint.uri")
    claim_checkpoint_root(root, {"job": "other", "namespace": "default", "uid": "other-uid"})
    theirs = store.step_dir(root, 10)
    (theirs / "data").write_atomic(b"the other job's")
    report = tmp_path / "termination-log"
    report.touch()
    job = write_job(tmp_path / "job.json", make_job(training={"maxSteps": 6}))
    p = launch_standalone(
        job,
        cwd=tmp_path,
        log=tmp_path / "t.log",
        nproc=1,
        procs=procs,
        max_restarts=3,
        FT_TERMINATION_LOG=str(report),
    )
    assert p.wait(180) == EXIT_CONFIG_ERROR, tail(p.log)
    log = p.log.read_text(errors="replace")
    assert log.count("unsupported job configuration") == 1, tail(p.log)  # one attempt, not 4
    assert "torchrun stopped without restarting the workers" in log
    error = parse_trainer_error(report.read_text())
    assert error is not None and "belongs to job default/other (uid other-uid)" in error
    assert (theirs / "data").read_text() == "the other job's"
    assert read_owner(root)["uid"] == "other-uid"  # type: ignore[index]
