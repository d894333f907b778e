"""LoRA checkpoints hold what changes (state.py, ignore_frozen_params): adapters, optimizer and
training state, no frozen base. Resuming one onto a freshly loaded base continues exactly the
loss curve of the run that never stopped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.api.spec import MethodSpec
from tests.trainer.conftest import (
    Proc,
    launch_standalone,
    make_job,
    step_lines,
    tail,
)
from tests.trainer.conftest import write_job as write

STEP4 = Path("checkpoints") / "quickstart" / "step-00000004"


def lora_job() -> JobConfig:
    # A constant LR: the schedule must not depend on anything but the step.
    job = make_job(strategy="fsdp-full-shard",
                   training={"maxSteps": 8, "schedule": "constant", "warmupSteps": 0},
                   checkpoint={"intervalSteps": 4})
    spec = job.spec.model_copy(update={"method": MethodSpec(type="lora")})
    return job.model_copy(update={"spec": spec})


def train(cwd: Path, procs: list[Proc]) -> list[dict[str, float]]:
    cwd.mkdir(exist_ok=True)
    p = launch_standalone(write(cwd / "job.json", lora_job()), cwd=cwd, log=cwd / "train.log",
                          procs=procs)
    assert p.wait(240) == 0, tail(p.log)
    return step_lines(p.log)


@pytest.mark.slow
def test_adapter_only_checkpoint_resumes_the_same_loss_curve(tmp_path: Path,
                                                             procs: list[Proc]) -> None:
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
