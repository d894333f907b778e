"""The trainer's cold start: phases timed from the process start, and a job importing only
what it uses (every rank pays each import again on every recovery)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune_trainer.startup import PHASES, StartupClock, process_age_seconds
from tests.trainer.conftest import make_job, one_rank_env, write_job

# Modules a LoRA-less jsonl job on a local volume with the torch backend never uses.
UNUSED = ("datasets", "deepspeed", "peft", "s3fs", "bitsandbytes")

# A single-rank world builds the whole trainer (process group, data, model, checkpointer,
# exporter) and resumes, as a worker does, then reports which of UNUSED got imported.
BUILD_TRAINER = f"""
import json, sys
from finetune_trainer.__main__ import main  # the entry path a worker runs
from finetune_trainer.config import RuntimeEnv, load_job_config
from finetune_trainer.distributed import destroy_distributed, exit_process
from finetune_trainer.trainer import Trainer
trainer = Trainer(load_job_config(sys.argv[1]), RuntimeEnv.from_environ())
trainer.checkpointer.load()
trainer.close()
destroy_distributed()
print(json.dumps(sorted(m for m in {UNUSED!r} if m in sys.modules)))
exit_process(0)  # as the trainer's __main__ ends: gloo's threads must not meet finalisation
"""


@pytest.mark.parametrize(
    ("stat", "uptime", "age"),
    [
        (
            "4242 (python) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 1000 20 21",
            "12.50 3.0",
            2.5,
        ),
        ("7 (a b) c)) R 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 500 20 21", "5.00 1.0", 0.0),
    ],
    ids=["plain", "command-with-spaces-and-parens"],
)
def test_process_age_from_proc(stat: str, uptime: str, age: float) -> None:
    assert process_age_seconds(stat, uptime, ticks_per_second=100) == pytest.approx(age)


def test_phases_are_timed_from_the_process_start_in_order() -> None:
    clock = StartupClock(started_at=100.0)
    clock.mark("imports", at=104.0)
    clock.mark("group", at=104.5)
    clock.mark("model", at=106.0)  # no data phase: its time counts in the next marked one
    clock.mark("first step", at=106.25)
    clock.mark("imports", at=200.0)  # a second mark of a phase changes nothing
    assert clock.durations() == {"imports": 4.0, "group": 0.5, "model": 1.5, "first step": 0.25}
    assert clock.summary() == (
        "started in 6.25 s: imports 4.00, group 0.50, model 1.50, first step 0.25"
    )
    assert clock.summary(cpu_seconds=3.5).startswith("started in 6.25 s (cpu 3.50 s): imports")
    with pytest.raises(ValueError, match="unknown startup phase 'load'"):
        clock.mark("load")
    assert PHASES[0] == "imports" and PHASES[-1] == "first step"


def test_a_plain_job_imports_only_what_it_uses(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.json", make_job())  # jsonl, full, DDP, local checkpoints
    env = one_rank_env()
    out = subprocess.run(
        [sys.executable, "-c", BUILD_TRAINER, str(job)],
        cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []
