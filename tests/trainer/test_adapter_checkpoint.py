"""LoRA checkpoints hold what changes (state.py, ignore_frozen_params): adapters, optimizer and
training state, no frozen base. Resuming one onto a freshly loaded base continues exactly the
loss curve of the run that never stopped; resuming one with another LoRA rank is refused
(checkpoint_compat), the checkpoints left as they were."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.api.spec import MethodSpec
from finetune_operator.reconcile.progress import parse_trainer_error
from finetune_trainer.refusal import EXIT_CONFIG_ERROR
from tests.trainer.conftest import (
    Proc,
    free_port,
    launch_standalone,
    make_job,
    step_lines,
    tail,
)
from tests.trainer.conftest import write_job as write

STEP4 = Path("checkpoints") / "quickstart" / "step-00000004"


def lora_job(rank: int = 16) -> JobConfig:
    # A constant LR: the schedule must not depend on anything but the step.
    job = make_job(
        strategy="fsdp-full-shard",
        training={"maxSteps": 8, "schedule": "constant", "warmupSteps": 0},
        checkpoint={"intervalSteps": 4},
    )
    method = MethodSpec.model_validate({"type": "lora", "lora": {"rank": rank}})
    spec = job.spec.model_copy(update={"method": method})
    return job.model_copy(update={"spec": spec})


def train(cwd: Path, procs: list[Proc]) -> list[dict[str, float]]:
    cwd.mkdir(exist_ok=True)
    p = launch_standalone(
        write(cwd / "job.json", lora_job()), cwd=cwd, log=cwd / "train.log", procs=procs
    )
    assert p.wait(240) == 0, tail(p.log)
    return step_lines(p.log)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_adapter_only_checkpoint_resumes_the_same_loss_curve(
    tmp_path: Path, procs: list[Proc]
) -> None:
    straight = train(tmp_path / "straight", procs)
    assert [s["step"] for s in straight] == list(range(1, 9))
    saved = dcp.FileSystemReader(str(tmp_path / "straight" / STEP4)).read_metadata()
    model_keys = [k for k in saved.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys
    assert any(k.startswith("optim.") for k in saved.state_dict_metadata)

    # A second run that finds only the step-4 checkpoint: base loaded again, adapters resumed.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight" / STEP4, resumed_dir / STEP4)
    resumed = train(resumed_dir, procs)
    assert "resumed from checkpoint step 4" in (resumed_dir / "train.log").read_text()
    assert [s["step"] for s in resumed] == list(range(5, 9))
    for a, b in zip(straight[4:], resumed, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (straight, resumed)

    # The job re-applied with another LoRA rank. Its adapters do not fit the checkpoints:
    # refused at once, every checkpoint untouched, none taken for damage (before: all moved
    # aside as .corrupt, training from step 0). One plain process (the refusal's way through
    # the launcher: test_ownership.py); not at the saving world size, which is not the reason.
    root = resumed_dir / STEP4.parent
    before = {k: v for k, v in files(root).items() if k not in ("OWNER", "EPOCH")}
    report = resumed_dir / "termination-log"
    report.touch()
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "FT_METRICS_BASE_PORT": "0",
        "OMP_NUM_THREADS": "1",
        "FT_TERMINATION_LOG": str(report),
    }
    out = subprocess.run(
        [sys.executable, "-m", "finetune_trainer", "--config",
         str(write(resumed_dir / "rank8.json", lora_job(rank=8)))],
        cwd=resumed_dir, env={**os.environ, **env}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == EXIT_CONFIG_ERROR, out.stderr[-3000:]
    error = parse_trainer_error(report.read_text())
    assert error is not None and "checkpoint step 8 in" in error, error
    assert re.search(r"lora_A\S* \(checkpoint: \[16, \d+\], this job: \[8, \d+\]\)", error), error
    assert {k: v for k, v in files(root).items() if k not in ("OWNER", "EPOCH")} == before
    assert not list(root.glob("*.corrupt")) and '"step"' not in out.stdout
