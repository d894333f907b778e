"""The staging buffer of async saves (staging.HostStaging: the whole checkpoint state, pinned
on CUDA) is freed once the final save is committed, before the export gathers the model on
rank 0's host: the two never add up (planner/checkpoint_memory.py counts the buffer, not the
export beside it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.trainer.conftest import make_job, one_rank_env, write_job

# A one-rank world trains the job to its end, as a worker does, and records what the
# checkpointer's staging held when the export began.
TRAIN = """
import json, sys
from finetune_trainer.config import RuntimeEnv, load_job_config
from finetune_trainer.distributed import destroy_distributed, exit_process
from finetune_trainer.trainer import Trainer
trainer = Trainer(load_job_config(sys.argv[1]), RuntimeEnv.from_environ())
seen = {}
export = trainer.exporter.export
def watched(step, **kw):
    staging = trainer.checkpointer.staging
    seen["allocations"] = staging.allocations
    seen["held"] = staging._buffer is not None
    return export(step, **kw)
trainer.exporter.export = watched
code = trainer.train()
trainer.close()
destroy_distributed()
print(json.dumps({"code": code, **seen}))
exit_process(0)
"""


def test_the_staging_buffer_is_freed_before_the_export(tmp_path: Path) -> None:
    job = make_job(
        training={"maxSteps": 2, "warmupSteps": 1}, checkpoint={"intervalSteps": 1, "async": True}
    )
    config = write_job(tmp_path / "job.json", job)
    env = one_rank_env()
    out = subprocess.run(
        [sys.executable, "-c", TRAIN, str(config)],
        cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    # The saves were staged (the buffer existed), and it was gone when the export began.
    assert seen == {"code": 0, "allocations": 1, "held": False}
    assert (tmp_path / "output" / "quickstart" / "FINISHED").exists()
