"""The per-rank step trace: what each rank writes, and that `ftjob stragglers` replays it."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import yaml

from finetune_operator.cli import main
from finetune_operator.stragglers.trace import read_traces
from finetune_trainer.config import RuntimeEnv
from finetune_trainer.metrics import StepStats
from finetune_trainer.steptrace import JsonlStepTrace, NoOpStepTrace, build_step_trace
from tests.conftest import EXAMPLES
from tests.trainer.conftest import (
    Proc,
    elastic_args,
    make_job,
    start_rendezvous_store,
    tail,
    trainer_env,
    write_job,
)


def stats(step: int, compute: float, wait: float) -> StepStats:
    return StepStats(step=step, loss=1.0, lr=1e-4, tokens=64, step_seconds=compute + wait,
                     compute_seconds=compute, wait_seconds=wait)  # fmt: skip


def test_disabled_without_the_env_variable() -> None:
    env = RuntimeEnv.from_environ({"RANK": "1"})
    assert env.step_trace_dir is None
    assert isinstance(build_step_trace(env, rank=1), NoOpStepTrace)


def test_each_step_is_on_disk_as_soon_as_it_is_recorded(tmp_path: Path) -> None:
    env = RuntimeEnv.from_environ({
        "RANK": "3", "POD_NAME": "job-worker-2", "NODE_NAME": "gpu-7",
        "TORCHELASTIC_RESTART_COUNT": "2", "FINETUNE_STEP_TRACE_DIR": str(tmp_path / "trace"),
    })  # fmt: skip
    trace = build_step_trace(env, rank=3)
    assert isinstance(trace, JsonlStepTrace)
    trace.record(stats(41, 0.5, 0.1), checkpoint=False)
    trace.record(stats(42, 0.6, 0.0), checkpoint=True)
    # Read before close: a pod killed mid-run leaves its steps behind.
    lines = [
        json.loads(line) for line in (tmp_path / "trace" / "rank-3.jsonl").read_text().splitlines()
    ]
    # The process's start: the same on every line of this run, a different one for the next.
    started = {line.pop("started") for line in lines}
    assert len(started) == 1 and abs(started.pop() - time.time()) < 60
    assert lines[1] == {
        "step": 42, "rank": 3, "pod": "job-worker-2", "node": "gpu-7", "restart": 2,
        "computeSeconds": 0.6, "waitSeconds": 0.0, "checkpoint": True,
    }  # fmt: skip
    trace.close()
    records = read_traces([tmp_path / "trace"])
    assert [(r.step, r.checkpoint, r.restart, r.node) for r in records] == [
        (41, False, 2, "gpu-7"), (42, True, 2, "gpu-7")
    ]  # fmt: skip
    assert records[0].started is not None and records[0].started == records[1].started


@pytest.mark.slow
def test_two_pods_one_slowed_replay_names_it(
    tmp_path: Path, procs: list[Proc], capsys: pytest.CaptureFixture[str]
) -> None:
    """Two torchrun agents (pods) through the standalone store; pod-b carries the step-delay
    knob, so its rank computes longer and pod-a waits for it. The written trace, replayed with
    a short-window policy, names pod-b and only pod-b."""
    steps = 30
    config = write_job(
        tmp_path / "job.json",
        make_job(training={"maxSteps": steps}, checkpoint={"intervalSteps": 20}),
    )
    port = start_rendezvous_store(tmp_path, procs)
    trace = tmp_path / "trace"
    agents = []
    for pod, ip, delay in (("pod-a", "127.0.0.2", "0"), ("pod-b", "127.0.0.3", "0.2")):
        args = elastic_args(
            config=config,
            endpoint=f"127.0.0.1:{port}",
            pod_ip=ip,
            min_nodes=2,
            max_nodes=2,
            restarts=0,
        )
        env = trainer_env(
            ip,
            FT_STEP_DELAY_SECONDS=delay,
            POD_NAME=pod,
            NODE_NAME=f"node-{pod}",
            FINETUNE_STEP_TRACE_DIR=str(trace),
        )
        agents.append(Proc(args, cwd=tmp_path, log=tmp_path / f"{pod}.log", env=env))
        procs.append(agents[-1])
    for a in agents:
        assert a.wait(240) == 0, tail(a.log)

    records = read_traces([trace])
    assert sorted((r.rank, r.step) for r in records) == [
        (k, s) for k in (0, 1) for s in range(1, steps + 1)
    ]
    assert {r.step for r in records if r.checkpoint} == {20, 30}
    by_pod = {r.pod: r for r in records if r.step == steps}
    assert by_pod["pod-b"].compute_seconds > 0.2 > by_pod["pod-b"].wait_seconds
    # pod-a waited for pod-b: on the median step (one step's wait, less pod-a's own compute on a
    # loaded machine, was seen at 0.14 s), and far longer than pod-b waited for it.
    waits = {pod: statistics.median(r.wait_seconds for r in records if r.pod == pod
                                    and not r.checkpoint) for pod in by_pod}  # fmt: skip
    assert waits["pod-a"] > 0.15 and waits["pod-a"] > 2 * waits["pod-b"], waits

    doc = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    doc["spec"]["faultTolerance"]["stragglers"] = {"windowSteps": 5, "consecutiveWindows": 3}
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(doc))
    assert main(["stragglers", str(trace), "--policy-from", str(tmp_path / "policy.yaml"),
                 "-o", "json"]) == 0  # fmt: skip
    found = json.loads(capsys.readouterr().out)["stragglers"]
    assert [(s["pod"], s["node"]) for s in found] == [("pod-b", "node-pod-b")], found
    assert found[0]["ratio"] > 1.5 and found[0]["detectedAtStep"] == 1 + 10 + 3 * 5 - 1
