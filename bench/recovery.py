"""Recovery and checkpoint-stall figures (issue 11), printed as tables.

    python bench/recovery.py                 # both parts
    python bench/recovery.py --part faults   # recovery time per fault on the local cluster
    python bench/recovery.py --part stall    # checkpoint stall per save, as steps lost
    python bench/recovery.py --part nodeloss --runs 3   # a worker's node partitioned

Faults: one long job on the local cluster goes through the fault sequence of the end-to-end
suite (`tests/e2e/faults.py`); for each, the time from the fault to training going past the
step it had reached (redone steps included), the steps redone, and what was counted.

Node loss: the end-to-end drill's job (`tests/e2e/nodeloss.py`: fixed size, 2 workers,
node monitor grace 4 s, nodeLostSeconds and collective timeouts 10 s) has worker-1's node
partitioned; from the loss to training past the step it had reached, and what was counted.

Stall: the quickstart trainer under real torchrun (2 ranks, gloo, CPU) with async checkpoints,
timed by when each step's line appears. Within the run, the step interval far from any save
(the second half of each save period) is the baseline; the time the first half of each period
takes beyond it is what one save costs: its blocking, plus the steps it slows while its
background write shares the CPU (an in-run ratio: immune to the load drifting between runs on
a shared machine). Shown as steps lost per save. A run without checkpoints is timed beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.e2e.faults: the fault drills the e2e suite runs

import yaml  # noqa: E402

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _job_json(path: Path, steps: int, interval: int | None) -> Path:
    from finetune_operator.api.jobconfig import JobConfig
    from finetune_operator.api.spec import FineTuneJobSpec
    from finetune_operator.planner import plan_job

    raw: dict[str, Any] = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())[
        "spec"
    ]
    raw["training"]["maxSteps"] = steps
    raw["checkpoint"] = {"uri": str(path.parent / "ckpt"), "intervalSteps": interval, "keep": 2}
    raw.pop("output", None)
    spec = FineTuneJobSpec.model_validate(raw)
    plan = plan_job(spec).model_copy(update={"nodes": 1, "gpus_per_node": 2, "world_size": 2})
    job = JobConfig(name="bench", namespace="default", uid="bench", spec=spec, plan=plan)
    path.write_text(json.dumps(job.to_json_dict()))
    return path


def _train(work: Path, steps: int, interval: int | None) -> list[float]:
    """Monotonic time at which each step line appeared (a step's line comes before its save)."""
    work.mkdir(parents=True)
    config = _job_json(work / "job.json", steps, interval)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FT_METRICS_BASE_PORT": "0",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}  # fmt: skip
    args = [TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "finetune_trainer",
            "--config", str(config)]  # fmt: skip
    stamps: list[float] = []
    with subprocess.Popen(args, cwd=work, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as proc:  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith('{"step"'):
                stamps.append(time.monotonic())
    if proc.returncode != 0 or len(stamps) != steps:
        raise RuntimeError(f"trainer run failed (exit {proc.returncode}, {len(stamps)} steps)")
    return stamps


def steps_lost_per_save(stamps: list[float], interval: int) -> tuple[float, float, list[float]]:
    """Within one run: the step interval far from saves (the second half of each save period)
    is the baseline; what the first half of each period takes beyond it (the save's blocking,
    then the steps it slows while its background write runs) is the stall of that save.
    Returns (baseline seconds, median stall seconds, stall per save)."""
    gaps = {
        i + 1: stamps[i] - stamps[i - 1] for i in range(1, len(stamps))
    }  # gap ending at step i+1
    saves = [s for s in range(interval, len(stamps) - interval + 1, interval)]
    half = interval // 2
    quiet = [gaps[s + j] for s in saves for j in range(half + 1, interval + 1) if s + j in gaps]
    base = statistics.median(quiet)
    stalls = [sum(gaps[s + j] - base for j in range(1, half + 1)) for s in saves]
    return base, statistics.median(stalls), stalls


def stall(steps: int, interval: int, rounds: int) -> str:
    rows = ["| run | steps | save every | saves measured | step far from saves | stall per save (median) | steps lost per save | median step, no checkpoints (same script) |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
        for r in range(rounds):
            with_ckpt = _train(Path(tmp) / f"ckpt-{r}", steps, interval)
            base_run = _train(Path(tmp) / f"base-{r}", steps, None)
            base, stall_s, stalls = steps_lost_per_save(with_ckpt, interval)
            plain = statistics.median(b - a for a, b in itertools.pairwise(base_run))
            rows.append(
                f"| {r + 1} | {steps} | {interval} | {len(stalls)} | {base * 1e3:.1f} ms "
                f"| {stall_s * 1e3:.1f} ms | {stall_s / base:.2f} | {plain * 1e3:.1f} ms |"
            )
    return "\n".join(rows)


def faults() -> str:
    from finetune_local.session import LocalSession, default_data_dir, is_finished
    from tests.e2e.faults import FAULTS_JOB, faults_job, run_drills

    doc = faults_job(yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text()))
    data = default_data_dir()  # not under /tmp: worker pods mount an emptyDir there
    with LocalSession(data, nodes=4, extra_env={"FT_STEP_DELAY_SECONDS": "0.2"}) as session:
        session.submit(doc)
        results = run_drills(session)
        session.wait_for(FAULTS_JOB, is_finished, timeout=600)
    shutil.rmtree(data, ignore_errors=True)
    rows = ["| fault | step at fault | resumed from | steps redone | recovery (fault -> past that step) | restarts | preemptions |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        redone = "" if r.resumed_from is None else str(max(0, r.step_at_fault - r.resumed_from))
        rows.append(f"| {r.fault} | {r.step_at_fault} | {r.resumed_from} | {redone} | {r.seconds:.1f} s "
                    f"| +{r.restarts} | +{r.preemptions} |")  # fmt: skip
    return "\n".join(rows)


def node_loss(runs: int) -> str:
    from finetune_local.session import default_data_dir, is_finished
    from tests.e2e.nodeloss import JOB, lose_worker_node, node_loss_job, node_loss_session

    rows = ["| run | step at fault | resumed from | recovery (loss -> past that step) | restarts | preemptions |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for run in range(1, runs + 1):
        doc = node_loss_job(yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text()))
        data = default_data_dir()
        with node_loss_session(data) as session:
            session.submit(doc)
            r = lose_worker_node(session).recovery
            job = session.wait_for(JOB, is_finished, timeout=300)
        shutil.rmtree(data, ignore_errors=True)
        status = job.get("status") or {}
        rows.append(f"| {run} | {r.step_at_fault} | {r.resumed_from} | {r.seconds:.1f} s "
                    f"| {status.get('restarts')} | {status.get('preemptions')} |")  # fmt: skip
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["faults", "stall", "nodeloss", "all"], default="all")
    parser.add_argument("--runs", type=int, default=3, help="node-loss drills")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"# recovery bench ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{os.cpu_count()} CPUs, shared machine: load drifts)\n")  # fmt: skip
    if args.part in ("stall", "all"):
        print("## Checkpoint stall per save (async DCP, 2 ranks, gloo, CPU)\n")
        print(stall(args.steps, args.interval, args.rounds) + "\n", flush=True)
    if args.part in ("faults", "all"):
        print(
            "## Recovery per fault (local cluster, 2 workers, step delay 0.2 s, checkpoint every 5)\n"
        )
        print(faults() + "\n", flush=True)
    if args.part in ("nodeloss", "all"):
        print("## Recovery from a lost node (local cluster, partition of worker-1's node)\n")
        print(node_loss(args.runs) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
