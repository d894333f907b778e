"""Recovery and checkpoint-stall figures (issue 11), printed as tables.

    python bench/recovery.py                 # both parts
    python bench/recovery.py --part faults   # recovery time per fault on the local cluster
    python bench/recovery.py --part stall    # checkpoint stall per save, as steps lost

Faults: one long job on the local cluster goes through the fault sequence of the end-to-end
suite (`tests/e2e/faults.py`); for each, the time from the fault to training going past the
step it had reached (redone steps included), the steps redone, and what was counted.

Stall: the quickstart trainer under real torchrun (2 ranks, gloo, CPU), the same number of
steps with and without async checkpoints in the same run of this script. The extra wall time
per save, over the median step time of the run without checkpoints, is the steps a save costs:
what it blocks, and what it slows the steps around it (the background write shares the CPU).
"""

from __future__ import annotations

import argparse
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

    raw: dict[str, Any] = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())["spec"]
    raw["training"]["maxSteps"] = steps
    raw["checkpoint"] = {"uri": str(path.parent / "ckpt"), "intervalSteps": interval, "keep": 2}
    raw.pop("output", None)
    spec = FineTuneJobSpec.model_validate(raw)
    plan = plan_job(spec).model_copy(update={"nodes": 1, "gpus_per_node": 2, "world_size": 2})
    job = JobConfig(name="bench", namespace="default", uid="bench", spec=spec, plan=plan)
    path.write_text(json.dumps(job.to_json_dict()))
    return path


def _train(work: Path, steps: int, interval: int | None) -> tuple[float, list[float]]:
    """Wall seconds from the first to the last step line, and the step times."""
    work.mkdir(parents=True)
    config = _job_json(work / "job.json", steps, interval)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FT_METRICS_BASE_PORT": "0",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}  # fmt: skip
    args = [TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "finetune_trainer",
            "--config", str(config)]  # fmt: skip
    stamps: list[float] = []
    step_times: list[float] = []
    with subprocess.Popen(args, cwd=work, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as proc:  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith('{"step"'):
                stamps.append(time.monotonic())
                step_times.append(float(json.loads(line)["step_seconds"]))
    if proc.returncode != 0 or len(stamps) != steps:
        raise RuntimeError(f"trainer run failed (exit {proc.returncode}, {len(stamps)} steps)")
    return stamps[-1] - stamps[0], step_times


def stall(steps: int, interval: int, rounds: int) -> str:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
        base_wall, with_wall, base_steps = [], [], []
        for r in range(rounds):  # interleaved, so machine load drifts hit both alike
            wall, times = _train(Path(tmp) / f"base-{r}", steps, None)
            base_wall.append(wall)
            base_steps.extend(times)
            with_wall.append(_train(Path(tmp) / f"ckpt-{r}", steps, interval)[0])
    saves = (steps - 1) // interval  # saves between the first and the last step line
    step_s = statistics.median(base_steps)
    extra = statistics.median(with_wall) - statistics.median(base_wall)
    per_save = extra / saves
    rows.append("| steps | save every | saves | median step (no ckpt) | wall no ckpt | wall with ckpt | stall per save | steps lost per save |")
    rows.append("|---|---|---|---|---|---|---|---|")
    rows.append(
        f"| {steps} | {interval} | {saves} | {step_s * 1e3:.1f} ms | {statistics.median(base_wall):.2f} s "
        f"| {statistics.median(with_wall):.2f} s | {per_save * 1e3:.1f} ms | {per_save / step_s:.2f} |"
    )
    return "\n".join(rows)


def faults() -> str:
    from finetune_operator.local.session import LocalSession, default_data_dir, is_finished
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
        redone = "" if r.resumed_from is None else str(r.step_at_fault - r.resumed_from)
        rows.append(f"| {r.fault} | {r.step_at_fault} | {r.resumed_from} | {redone} | {r.seconds:.1f} s "
                    f"| +{r.restarts} | +{r.preemptions} |")  # fmt: skip
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["faults", "stall", "all"], default="all")
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
        print("## Recovery per fault (local cluster, 2 workers, step delay 0.2 s, checkpoint every 5)\n")
        print(faults() + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
