"""Failures counted by rendezvous round, under real torchrun (reconcile/budget.py): two
"pods" (two launchers, one rank each, one c10d rendezvous) whose ranks
both raise at the same step at every attempt: each pod's crash report names the same rounds,
so the operator counts one restart per round, not one per pod."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from finetune_operator.api.status import FineTuneJobStatus
from tests.operator.test_budget import _run, _start
from tests.operator.test_disposition import ended
from tests.operator.test_reconcile import deleted
from tests.trainer.conftest import LAUNCHER, Proc, free_port, tail, trainer_env

# Every rank raises at the same step, after its group agreed on the round's id (as the
# trainer does right after the process group forms: trainer.py).
WORKER = """
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from finetune_trainer.crash import write_round_id
from finetune_trainer.distributed import default_store
from finetune_trainer.startup_barrier import StartupBarrier


@record
def main() -> None:
    dist.init_process_group("gloo")
    barrier = StartupBarrier(default_store(), dist.get_rank(), dist.get_world_size(), 10.0)
    write_round_id(barrier.agree_round_id())
    dist.barrier()  # both ranks hold the id before either raises
    raise ValueError("a bad batch at step 3, on every rank")


main()
"""


@pytest.mark.slow
def test_a_failure_every_pod_hits_at_once_is_one_restart_per_round(
    tmp_path: Path, procs: list[Proc]
) -> None:
    (tmp_path / "roundworker.py").write_text(WORKER)
    port = free_port()  # pod 0's agent hosts the rendezvous (no store process to start)
    pods = []
    for n in (0, 1):
        log = tmp_path / f"termination-log-{n}"
        log.touch()
        args = [*LAUNCHER, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=rounds",
                "--max-restarts=1",
                "--local-addr=127.0.0.1", "-m", "roundworker"]  # fmt: skip
        env = trainer_env("127.0.0.1", FT_TERMINATION_LOG=str(log), PYTHONPATH=":".join(sys.path))
        pods.append((Proc(args, cwd=tmp_path, log=tmp_path / f"pod-{n}.log", env=env), log))
        procs.append(pods[-1][0])
    crashes = []
    for proc, log in pods:
        assert proc.wait(120) == 1, tail(proc.log)
        crashes.append(json.loads(log.read_text())["crash"])
    # One restart each (after the first round), both in the same round; the same last round.
    first, second = crashes
    assert first["rounds"] == second["rounds"] and len(first["rounds"]) == 1, crashes
    assert first["round"] == second["round"] != first["rounds"][0], crashes
    assert all(re.fullmatch(r"[0-9a-f]{16}", r) for r in (*first["rounds"], first["round"]))
    # The operator, given both pods' ends: 2 failed rounds, 2 restarts (one per pod: 4).
    ends = [
        ended(f"qs-worker-{n}", exit_code=1, report={"crash": c}) for n, c in enumerate(crashes)
    ]
    out = _run(_start(), ends)
    assert isinstance(out.status, FineTuneJobStatus)
    assert (out.status.restarts, out.status.phase) == (2, "Restarting"), out.status
    assert out.status.restart_ledger == [*first["rounds"], first["round"]]
    assert sorted(deleted(out)) == ["qs-rdzv", "qs-worker-0", "qs-worker-1"]
