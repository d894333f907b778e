"""Elastic re-forming through the standalone rendezvous store: lose a node, gain a node."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from finetune_operator.api.constants import CHECKPOINT_COMMITTED_MARKER
from tests.trainer.conftest import (
    Proc,
    elastic_args,
    make_job,
    start_rendezvous_store,
    step_lines,
    tail,
    trainer_env,
    wait_until,
    write_job,
)

pytestmark = pytest.mark.slow


def committed_steps(root: Path) -> list[int]:
    return sorted(
        int(p.parent.name.split("-")[1]) for p in root.glob(f"step-*/{CHECKPOINT_COMMITTED_MARKER}")
    )


def worlds(log: Path) -> list[int]:
    return [int(m) for m in re.findall(r"trainer: world (\d+),", log.read_text(errors="replace"))]


def test_lose_a_node_then_gain_one(tmp_path: Path, procs: list[Proc]) -> None:
    job = make_job(training={"maxSteps": 50}, checkpoint={"intervalSteps": 5})
    config = write_job(tmp_path / "job.json", job)
    ckpt = tmp_path / "checkpoints" / "quickstart"
    port = start_rendezvous_store(tmp_path, procs)

    def agent(name: str, ip: str) -> Proc:
        args = elastic_args(
            config=config,
            endpoint=f"127.0.0.1:{port}",
            pod_ip=ip,
            min_nodes=1,
            max_nodes=2,
            restarts=3,
        )
        p = Proc(
            args,
            cwd=tmp_path,
            log=tmp_path / f"{name}.log",
            env=trainer_env(ip, FT_STEP_DELAY_SECONDS="0.15"),
        )
        procs.append(p)
        return p

    a, b = agent("a", "127.0.0.2"), agent("b", "127.0.0.3")
    wait_until(
        lambda: 2 in worlds(a.log) and committed_steps(ckpt)[-1:] >= [10],
        90,
        "world 2 and a checkpoint at step >= 10",
        a.log,
    )
    b.kill(signal.SIGKILL)  # the pod dies: agent and its worker
    wait_until(lambda: worlds(a.log)[-1:] == [1], 90, "survivor re-formed at world 1", a.log)
    wait_until(
        lambda: any(s["step"] > committed_steps(ckpt)[0] + 5 for s in step_lines(a.log)),
        60,
        "progress at world 1",
        a.log,
    )
    c = agent("c", "127.0.0.4")
    assert a.wait(180) == 0, tail(a.log)
    assert c.wait(60) == 0, tail(c.log)

    log = a.log.read_text()
    assert worlds(a.log)[:1] == [2] and 1 in worlds(a.log) and worlds(a.log)[-1] == 2, worlds(a.log)
    resumed = [int(s) for s in re.findall(r"resumed from checkpoint step (\d+)", log)]
    assert len(resumed) >= 2 and all(s > 0 for s in resumed), resumed
    final = json.loads((ckpt / "step-00000050" / CHECKPOINT_COMMITTED_MARKER).read_text())
    assert final["worldSize"] == 2 and final["step"] == 50
    assert len(committed_steps(ckpt)) <= 3  # keep: 3
